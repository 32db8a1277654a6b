"""What the Mosaic GPU decode-attention kernel takes: its config, the cache layouts it
supports (and why one is refused), and the constants its tiles are built on. No Mosaic
imports: the checks run on any backend."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from pallas_kernels.decode_attention import mosaic_gpu_ptx as ptx
from pallas_kernels.decode_attention.merge_triton import MergeConfig
from pallas_kernels.kv import layout as kl

SLOT = ptx.SLOT            # 64 tokens per code slot = M of the key MMA
MAX_HEADS = 16             # most query heads per kv-head (the MMAs' N: 8 up to 8 heads, else 16)
MAX_OUTLIERS = 4


@dataclasses.dataclass(frozen=True)
class MosaicGpuConfig:
  """Tuning knobs of the Mosaic GPU implementation.

  num_splits: programs per (sequence, kv-head) over the quantized region (a divisor of
    the tile count is taken); None: enough for about ``target_programs`` programs, one
    wave with two programs per SM (H200, B=8 32k: 4 splits 0.093-0.095 ms, 8 splits
    0.096-0.097; B=1 128k: 32 splits 0.053-0.054, 64 0.059).
  merge: the merge kernel's knobs.
  """
  num_splits: int | None = None
  target_programs: int = 256
  merge: MergeConfig = MergeConfig()

  def __post_init__(self):
    if self.num_splits is not None and (isinstance(self.num_splits, bool) or self.num_splits < 1):
      raise ValueError(f"num_splits must be None or an int >= 1, got {self.num_splits!r}")
    if self.target_programs < 1:
      raise ValueError(f"target_programs must be >= 1, got {self.target_programs!r}")


def supports(layout: kl.KVLayout, num_q_heads_per_kv: int) -> bool:
  """Whether this kernel handles caches of this layout."""
  return unsupported_reason(layout, num_q_heads_per_kv) is None


def unsupported_reason(layout: kl.KVLayout, num_q_heads_per_kv: int) -> str | None:
  cfg = layout.config
  g = cfg.group_size
  tile = SLOT * layout.cpw
  if (cfg.key_axis, cfg.value_axis) != ("channel", "token"):
    return f"needs keys per channel and values per token, got {cfg.key_axis}/{cfg.value_axis}"
  if layout.d_pad % 64:
    return f"needs D_pad a multiple of 64, got {layout.d_pad}"
  if layout.cq == 0:
    return "the cache has no quantized region"
  if not (g >= 32 and (SLOT % g == 0 or g % SLOT == 0) and tile % g == 0):
    return f"group_size {g} must be >= 32, divide or be a multiple of 64, and divide {tile}"
  if layout.n_out > MAX_OUTLIERS:
    return f"at most {MAX_OUTLIERS} outlier channels, got {layout.n_out}"
  if num_q_heads_per_kv > MAX_HEADS:
    return f"at most {MAX_HEADS} query heads per kv-head, got {num_q_heads_per_kv}"
  if cfg.meta_dtype != "float8_e4m3fn":
    # the zero-point folds into the fp16 fma as z - s * 2**k, rounded to fp16: exact enough for
    # fp8 zero-points, not for 16-bit ones (H100, 2026-12-07: 1.0-1.9 % relative error against
    # the reference with bf16/fp16 metadata, 0.19 % with fp8; Triton 0.2-0.3 %)
    return f"needs float8_e4m3fn metadata (16-bit zero-points lose precision in its fp16 fma), got {cfg.meta_dtype}"
  meta_bytes = jnp.dtype(cfg.meta_dtype).itemsize
  kr, ng = max(1, tile // g), layout.n_groups_tok
  for shape, itemsize in (((kr, layout.d_pad), meta_bytes), ((ng, tile), meta_bytes),
                          ((kr, layout.d_pad), 2), ((ng, tile), 2)):
    vec = _strided_vector(shape, itemsize)
    if vec & (vec - 1):
      return (f"would load its {shape} metadata tile as {vec}-element vectors "
              f"(Mosaic GPU lowers only powers of two)")
  return None


def _strided_vector(shape, itemsize: int) -> int:
  """Elements per vector of Mosaic GPU's strided layout for a whole-array load of ``shape``
  (as ``WGStridedFragLayout.from_shaped_type`` picks it; 1 where that layout is not used)."""
  n, rem = divmod(int(np.prod(shape)), 128)
  if rem or n == 0:
    return 1
  vec = min(8 // itemsize, n)
  while vec > 0 and n % vec:
    vec //= 2
  return max(vec, 1)
