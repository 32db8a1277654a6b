"""pallas_kernels: reusable Pallas kernels: sub-byte packing, quantized-KV decode attention,
grouped matmul. Imports jax and numpy only, never moejax.

One folder per op, each with ``api.py`` (the public function, its checks, the choice of
implementation), one file per implementation and a plain-``jnp`` ``reference.py`` that
only the tests import:

* ``kv/``: ``packing`` (2/3/4/8-bit codes in uint32 or uint16 words, lowest bits first,
  pack blocks of ``stride * codes_per_word`` elements), ``layout`` (``KVQuantConfig``,
  ``KVLayout``: the shapes and channel order every kernel reads), ``quant``
  (``quantize_kv``, ``QuantizedKV`` with exact ``nbytes`` / ``bits_per_element``,
  ``append_kv``, ``empty_kv``, ``select_outlier_channels``, ``kv_bits_per_element``).
* ``decode_attention/``: ``decode_attention(q [B, H, A], kv: QuantizedKV) -> [B, H, A]``
  and ``decode_attention_bf16(q, k [B, N, S, A], v, lengths [B])``; implementations
  ``mosaic_gpu`` (Hopper), ``triton``, ``tpu``, ``xla``.
* ``gmm/``: ``gmm`` / ``tgmm`` (grouped matmul over experts, custom_vjp), quantized
  expert weights dequantized in the kernel.

Every op takes ``implementation=`` (``None``: by device; a name; or an ordered list, each
tried until one takes the inputs) and ``config=`` (one frozen dataclass of tuning knobs per
implementation), see ``pallas_kernels._implementation``. ``interpret=None`` compiles on
GPU/TPU and runs Pallas' interpret mode on CPU.

The package attributes ``decode_attention`` and ``gmm`` are the functions; their modules
are reached as ``from pallas_kernels.decode_attention import api``.
"""

# --- packing / KV quantization / decode attention ---
from pallas_kernels.kv import (  # noqa: E402
    KVLayout, KVQuantConfig, QuantizedKV, append_kv, codes_per_word, empty_kv,
    kv_bits_per_element, pack, pack_jnp, padded_length, quantize_kv, select_outlier_channels,
    unpack, unpack_jnp)
from pallas_kernels._implementation import Unsupported  # noqa: E402
from pallas_kernels.decode_attention import decode_attention, decode_attention_bf16  # noqa: E402

# --- grouped matmul (experts) ---
# (configs: pallas_kernels.gmm.TritonConfig / TpuConfig, decode_attention.MosaicGpuConfig, ...)
from pallas_kernels.gmm import (  # noqa: E402
    GmmTiling, QuantizedExpertWeights, default_tiling, dequantize_expert_weights, gmm,
    quantize_expert_weights, tgmm)
