"""pallas_kernels: reusable Pallas kernels (sub-byte packing, quantized-KV decode attention, grouped matmul).

Imports jax and numpy only — never moejax. Every kernel takes ``interpret=None``
(compiled on GPU through Pallas' Triton lowering, interpreted on CPU) and has a
plain ``jnp`` twin in ``pallas_kernels.reference``.

Packing (``pallas_kernels.packing``): unsigned 2/3/4/8-bit codes in uint32
words (16/10/8/4 codes; 3-bit: bits 30-31 unused) or, with ``word_bits=16``,
uint16 words (8/5/4/2 codes), lowest bits first.
Along the packed axis, pack blocks of ``stride * codes_per_word`` elements
become ``stride`` words; element ``r`` of a block goes to word ``r % stride``,
slot ``r // stride`` (``stride=1``: the usual contiguous layout).

* ``pack(codes[..., n, ...], bits, axis, stride, word_bits=32) -> uint32[..., n / cpw, ...]``
  (Pallas); ``unpack`` its inverse; ``pack_jnp`` / ``unpack_jnp`` the XLA versions.

KV quantization (``pallas_kernels.kv_quant``), per attention layer, keys and
values ``[B, H, T, D]``:

* ``KVQuantConfig(bits, group_size, outlier_fraction, residual_window,
  sink_tokens, key_axis, value_axis, meta_dtype, dtype)``.
* ``quantize_kv(k, v, config, max_len=, lengths=, k_outlier_idx=, v_outlier_idx=)
  -> QuantizedKV``: a pytree of static shapes (capacity ``max_len``): uint16 codes
  packed along tokens (stride 64), scales and zeros (``meta_dtype``), 16-bit
  outlier channels and their int32 indices, a full-precision sink + window ring,
  int32 lengths. ``.append(k_new [B, H, D], v_new)`` (jit-able; flushes whole
  groups), ``.dequantize() -> (k, v, valid)``, ``.nbytes``, ``.bits_per_element``.
* ``empty_kv``, ``append_kv``, ``select_outlier_channels``, ``kv_bits_per_element``.

Decode attention (module ``pallas_kernels.decode_attention``; the package
attribute of that name is the function):

* ``decode_attention(q [B, Hq, D], kv: QuantizedKV, backend="auto") -> [B, Hq, D]``:
  GQA (``Hq`` a multiple of ``H``), per-sequence lengths, split-K over the
  sequence, packed codes dequantized in registers. ``backend="auto"`` runs the
  Mosaic GPU kernel (``decode_attention_mgpu``) on Hopper GPUs for the layouts its
  ``supports`` accepts (keys per channel, values per token, G >= 32, at most 4
  outlier channels, at most 16 query heads per kv-head), on a TPU the block-spec Pallas TPU
  kernel (``decode_attention_tpu``; tested in TPU interpret mode only), else the
  Triton kernel (which also runs in interpret mode); ``"triton"`` / ``"mosaic"`` /
  ``"tpu"`` force one.
* ``decode_attention_bf16(q, k [B, H, T, D], v, lengths [B]) -> [B, Hq, D]``.
"""

# --- packing / KV quantization / decode attention ---
from pallas_kernels.packing import (  # noqa: E402
    codes_per_word, pack, pack_jnp, padded_length, unpack, unpack_jnp)
from pallas_kernels.kv_quant import (  # noqa: E402
    KVLayout, KVQuantConfig, QuantizedKV, append_kv, empty_kv, kv_bits_per_element,
    quantize_kv, select_outlier_channels)
from pallas_kernels.decode_attention import decode_attention, decode_attention_bf16  # noqa: E402

# --- grouped matmul (experts) ---
from pallas_kernels.gmm import gmm, tgmm  # noqa: E402
from pallas_kernels.gmm_plan import GmmTiling, default_tiling  # noqa: E402
from pallas_kernels.gmm_quant import (  # noqa: E402
    QuantizedExpertWeights, dequantize_expert_weights, quantize_expert_weights)
