"""The layout every KV kernel reads: quantizer settings, static shapes, channel order.

``KVQuantConfig`` holds the quantizer's settings; ``KVLayout(config, head_dim, max_len)``
derives every static shape of a ``QuantizedKV`` from them (see ``pallas_kernels.kv.quant``
for the arrays). The split channel order: the ``D_low`` non-outlier channels ascending,
then the ``n_out`` outlier channels (``low_channel_index``, ``channel_positions``,
``from_split``). ``fp_slot_positions`` maps the full-precision ring to token positions.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv import packing

PACK_STRIDE = 64          # words per pack block along the token axis (= tokens per code slot)
WORD_BITS = 16            # uint16 code words
_AXES = ("channel", "token")
_META_DTYPES = ("bfloat16", "float16", "float8_e4m3fn")
_FP_DTYPES = ("bfloat16", "float16")


def _pos_int(name, v, minimum=0):
  if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")


@dataclasses.dataclass(frozen=True)
class KVQuantConfig:
  """Settings of the KV quantizer.

  bits: 2, 3, 4 or 8.
  group_size: G, tokens (per-channel axis) or channels (per-token axis) sharing
    one scale/zero; a power of two >= 16.
  outlier_fraction: fraction of head channels kept in 16 bits, per (sequence,
    kv-head), separately for keys and values; 0 <= f < 1.
  residual_window: R, most recent tokens kept in full precision; a multiple of G.
  sink_tokens: S, first tokens kept in full precision.
  key_axis / value_axis: "channel" (a scale per channel over G tokens) or
    "token" (a scale per token over G channels).
  meta_dtype: dtype of scales and zero-points: "bfloat16", "float16" or
    "float8_e4m3fn" (8-bit metadata; |values| must stay below 448).
  dtype: full-precision parts (outliers, window, sinks): "bfloat16" or "float16".
  """
  bits: int = 2
  group_size: int = 32
  outlier_fraction: float = 0.15
  residual_window: int = 0
  sink_tokens: int = 0
  key_axis: str = "channel"
  value_axis: str = "token"
  meta_dtype: str = "float8_e4m3fn"
  dtype: str = "bfloat16"

  def __post_init__(self):
    packing.check_bits(self.bits)
    _pos_int("group_size", self.group_size, 16)
    if self.group_size & (self.group_size - 1):
      raise ValueError(f"group_size must be a power of two >= 16, got {self.group_size}")
    f = self.outlier_fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not (0.0 <= f < 1.0):
      raise ValueError(f"outlier_fraction must be in [0, 1), got {f!r}")
    _pos_int("residual_window", self.residual_window)
    if self.residual_window % self.group_size:
      raise ValueError(
          f"residual_window ({self.residual_window}) must be a multiple of group_size "
          f"({self.group_size}): the window is flushed in whole groups")
    _pos_int("sink_tokens", self.sink_tokens)
    for name in ("key_axis", "value_axis"):
      if getattr(self, name) not in _AXES:
        raise ValueError(f"{name} must be one of {_AXES}, got {getattr(self, name)!r}")
    if self.meta_dtype not in _META_DTYPES:
      raise ValueError(f"meta_dtype must be one of {_META_DTYPES}, got {self.meta_dtype!r}")
    if self.dtype not in _FP_DTYPES:
      raise ValueError(f"dtype must be one of {_FP_DTYPES}, got {self.dtype!r}")

  def num_outliers(self, head_dim: int) -> int:
    """Outlier channels per (sequence, kv-head): round(f * D), at least 1 if f > 0."""
    if self.outlier_fraction == 0:
      return 0
    n = max(1, int(round(self.outlier_fraction * head_dim)))
    if n >= head_dim:
      raise ValueError(f"outlier_fraction {self.outlier_fraction} leaves no low-bit channel "
                       f"of head_dim {head_dim}")
    return n


@dataclasses.dataclass(frozen=True)
class KVLayout:
  """Static shapes derived from (config, head_dim, max_len)."""
  config: KVQuantConfig
  head_dim: int
  max_len: int

  @property
  def cpw(self): return packing.codes_per_word(self.config.bits, WORD_BITS)
  @property
  def pack_tokens(self): return PACK_STRIDE * self.cpw          # P: tokens per 64-word tile
  @property
  def n_out(self): return self.config.num_outliers(self.head_dim)
  @property
  def d_low(self): return self.head_dim - self.n_out
  @property
  def d_pad(self): return -(-self.d_low // 16) * 16
  @property
  def n_groups_tok(self): return -(-self.d_low // self.config.group_size)
  @property
  def ring(self): return self.config.residual_window + self.config.group_size
  @property
  def fp_slots(self): return self.config.sink_tokens + self.ring
  @property
  def cq(self):
    c = self.config
    need = max(self.max_len - c.sink_tokens - c.residual_window, 0)
    unit = math.lcm(self.pack_tokens, c.group_size)
    return -(-need // unit) * unit

  def meta_shape(self, axis):
    g = self.config.group_size
    if axis == "channel":
      return (self.cq // g, self.d_pad)
    return (self.n_groups_tok, self.cq)

  def num_quantized(self, lengths):
    """nq: tokens in the quantized region for sequences of these lengths."""
    c = self.config
    g = c.group_size
    n = jnp.maximum(lengths - c.sink_tokens - c.residual_window, 0) // g * g
    return jnp.minimum(n, self.cq).astype(jnp.int32)


def low_channel_index(outlier_idx: jax.Array, head_dim: int) -> jax.Array:
  """Ascending non-outlier channels: ``int32[..., head_dim - n_out]`` (outlier_idx: distinct
  channels ``[..., n_out]`` in any order).

  No sort or scatter (on a GPU each is a slow kernel of its own, costlier than a small
  decode step): with ``t_k = idx_k - #{m : idx_m < idx_k}`` (the non-outlier channels
  below ``idx_k``), the j-th non-outlier channel is ``j + #{k : t_k <= j}``."""
  idx = outlier_idx.astype(jnp.int32)
  n_out = idx.shape[-1]
  t = idx - _count_over_outliers(lambda m: idx[..., m:m + 1] < idx, n_out)        # [..., n_out]
  j = jnp.arange(head_dim - n_out, dtype=jnp.int32)
  lo = j + _count_over_outliers(lambda k: t[..., k:k + 1] <= j, n_out)
  return jnp.broadcast_to(lo, idx.shape[:-1] + j.shape)


def _count_over_outliers(pred, n_out: int):
  """sum_k pred(k) as int32. Unrolled for a few outlier channels, so that XLA fuses the
  index arithmetic into its consumer (a reduction would be a GPU kernel of its own)."""
  if n_out <= _UNROLL_OUTLIERS:
    return sum((pred(k).astype(jnp.int32) for k in range(n_out)), jnp.int32(0))
  return jnp.stack([pred(k) for k in range(n_out)], -1).sum(-1, dtype=jnp.int32)


_UNROLL_OUTLIERS = 8


def channel_positions(outlier_idx: jax.Array, head_dim: int) -> jax.Array:
  """Where each channel sits in the split form ``[non-outliers ascending (d_low),
  outliers in outlier_idx order]``: ``int32[..., head_dim]``, so that
  ``from_split(lo, out, positions, n_out)`` puts split values back in channel order."""
  idx = outlier_idx.astype(jnp.int32)
  n_out = idx.shape[-1]
  c = jnp.arange(head_dim, dtype=jnp.int32)
  below = _count_over_outliers(lambda k: idx[..., k:k + 1] < c, n_out)           # [..., D]
  slot = jnp.full(idx.shape[:-1] + (head_dim,), -1, jnp.int32)
  for k in range(n_out):                                    # outlier channel -> its index k
    slot = jnp.where(idx[..., k:k + 1] == c, k, slot)
  return jnp.where(slot >= 0, head_dim - n_out + slot, c - below)


def from_split(lo: jax.Array, out: jax.Array | None, positions: jax.Array, n_out: int) -> jax.Array:
  """Split-form values -> channel order, by a gather (no scatter).

  lo ``[..., >= D - n_out]`` (non-outlier channels ascending; padding beyond ignored), out
  ``[..., >= n_out]`` (None when n_out is 0), positions ``int32[..., D]`` from
  ``channel_positions``, with as many axes as the values (size-1 axes broadcast).
  Returns ``[..., D]``."""
  d = positions.shape[-1]
  x = lo[..., :d - n_out]
  if n_out:
    x = jnp.concatenate([x, out[..., :n_out].astype(x.dtype)], axis=-1)
  positions = jnp.broadcast_to(positions, x.shape[:-1] + (d,))
  return jnp.take_along_axis(x, positions, axis=-1)


def fp_slot_positions(layout: KVLayout, lengths):
  """Position held by each full-precision slot, and whether it holds one: [B, F]."""
  cfg = layout.config
  s, wc = cfg.sink_tokens, layout.ring
  slot = jnp.arange(layout.fp_slots)
  m = (lengths - s)[:, None]                                   # tokens past the sinks
  r = slot[None, :] - s
  last = m - 1
  p_ring = s + last - jnp.mod(last - r, wc)
  is_sink = slot[None, :] < s
  pos = jnp.where(is_sink, slot[None, :], p_ring)
  held = jnp.where(is_sink, slot[None, :] < lengths[:, None], (m > 0) & (p_ring >= s))
  return pos.astype(jnp.int32), held
