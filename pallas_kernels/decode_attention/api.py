"""Decode attention (one query token per sequence): the public functions, their input
checks and the choice of implementation.

``decode_attention(q, kv)`` attends to a packed, quantized ``QuantizedKV``;
``decode_attention_bf16(q, k, v, lengths)`` to a plain 16-bit cache. ``implementation``:
``None`` (by device, below), a name, or an ordered sequence of names; an implementation
that cannot take the inputs is skipped for the next (``pallas_kernels._implementation``).

Default order for a quantized cache: on a Hopper GPU ``mosaic_gpu`` (``mosaic_gpu.py``:
the fastest at every size timed, 4k-128k tokens, B = 1 and 8) then ``triton`` (every
layout); on another GPU and on CPU (interpret mode) ``triton``; on a TPU ``tpu`` then
``xla``. For a bf16 cache: ``triton`` on GPU and CPU, ``xla`` on TPU.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import _implementation as impl_lib
from pallas_kernels._implementation import dispatch, resolve_interpret
from pallas_kernels.decode_attention.mosaic_gpu import MosaicGpuConfig, decode_attention_mosaic
from pallas_kernels.decode_attention.tpu import decode_attention_tpu
from pallas_kernels.decode_attention.triton import TritonConfig, decode_attention_triton
from pallas_kernels.decode_attention.triton_bf16 import TritonBf16Config, decode_attention_bf16_triton
from pallas_kernels.decode_attention.xla import decode_attention_bf16_xla, decode_attention_xla
from pallas_kernels.kv.quant import QuantizedKV

IMPLEMENTATIONS = {"mosaic_gpu": decode_attention_mosaic, "triton": decode_attention_triton,
                   "tpu": decode_attention_tpu, "xla": decode_attention_xla}
CONFIGS = {"mosaic_gpu": MosaicGpuConfig, "triton": TritonConfig}
BF16_IMPLEMENTATIONS = {"triton": decode_attention_bf16_triton, "xla": decode_attention_bf16_xla}
BF16_CONFIGS = {"triton": TritonBf16Config}


def default_order(interpret: bool) -> tuple[str, ...]:
  """The implementations ``implementation=None`` tries for a quantized cache."""
  device = impl_lib.platform()
  if device == "tpu" and not interpret:
    return ("tpu", "xla")
  if device == "gpu" and not interpret and impl_lib.is_hopper():
    return ("mosaic_gpu", "triton")
  return ("triton", "xla")


def decode_attention(q: jax.Array, kv: QuantizedKV, *, sm_scale: float | None = None,
                     implementation: str | Sequence[str] | None = None, config=None,
                     interpret: bool | None = None) -> jax.Array:
  """Attention of one query token per sequence to a quantized KV cache.

  Args:
    q: ``[B, H, A]`` (any float dtype; the output has the same dtype). Query head ``i``
      uses kv-head ``i // (H // N)``.
    kv: ``QuantizedKV`` with batch ``B``, ``N`` kv-heads, head dim ``A``; its ``lengths``
      say how many positions each sequence attends to.
    sm_scale: softmax scale, default ``1 / sqrt(A)``.
    implementation: ``"mosaic_gpu"``, ``"triton"``, ``"tpu"``, ``"xla"``, an ordered
      sequence of them, or ``None`` (the device's default order, see the module docstring).
    config: ``MosaicGpuConfig`` or ``TritonConfig`` (for that implementation; the others
      run with their defaults).
    interpret: ``None`` = compiled on GPU/TPU, Pallas interpret mode on CPU.
  Returns:
    ``[B, H, A]``; zeros for a sequence of length 0.
  """
  if getattr(q, "ndim", None) != 3:
    raise ValueError(f"q must be [B, H, A], got shape {getattr(q, 'shape', None)}")
  if not isinstance(kv, QuantizedKV):
    raise ValueError(f"kv must be a QuantizedKV, got {type(kv).__name__}")
  b, hq, d = q.shape
  if (b, d) != (kv.batch, kv.layout.head_dim):
    raise ValueError(f"q [B, H, A] = {q.shape} does not match the cache "
                     f"(B={kv.batch}, A={kv.layout.head_dim})")
  if hq % kv.num_heads:
    raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({kv.num_heads})")
  sm_scale = float(1.0 / math.sqrt(d) if sm_scale is None else sm_scale)
  interpret = resolve_interpret(interpret)
  return dispatch("decode_attention", IMPLEMENTATIONS, implementation,
                  lambda: default_order(interpret), config, CONFIGS, q, kv, sm_scale=sm_scale,
                  interpret=interpret)


def decode_attention_bf16(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
                          sm_scale: float | None = None,
                          implementation: str | Sequence[str] | None = None, config=None,
                          interpret: bool | None = None) -> jax.Array:
  """Decode attention on an unquantized cache.

  q: ``[B, H, A]``; k, v: ``[B, N, S, A]`` (bf16 or f16; read as is); lengths: ``int[B]``
  valid positions per sequence. Returns ``[B, H, A]``. implementation: ``"triton"``,
  ``"xla"``, a sequence, or ``None`` (``xla`` on TPU, else ``triton``); config:
  ``TritonBf16Config``.
  """
  if getattr(q, "ndim", None) != 3 or getattr(k, "ndim", None) != 4 or k.shape != v.shape:
    raise ValueError(f"need q [B, H, A] and k, v [B, N, S, A]; got "
                     f"{getattr(q, 'shape', None)}, {getattr(k, 'shape', None)}, {getattr(v, 'shape', None)}")
  b, hq, d = q.shape
  if k.shape[0] != b or k.shape[3] != d:
    raise ValueError(f"q {q.shape} does not match k {k.shape}")
  if hq % k.shape[1]:
    raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({k.shape[1]})")
  lengths = jnp.asarray(lengths)
  if lengths.shape != (b,):
    raise ValueError(f"lengths must be [B] = [{b}], got {lengths.shape}")
  sm_scale = float(1.0 / math.sqrt(d) if sm_scale is None else sm_scale)
  interpret = resolve_interpret(interpret)
  default = lambda: ("xla",) if impl_lib.platform() == "tpu" and not interpret else ("triton",)
  return dispatch("decode_attention_bf16", BF16_IMPLEMENTATIONS, implementation, default, config,
                  BF16_CONFIGS, q, k, v, lengths, sm_scale=sm_scale, interpret=interpret)
