"""How a grouped matmul is split into tiles: the Config classes and per-tile group metadata.

Shapes: M rows (sorted by group), I contraction, O output width, E groups (experts).
A *work tile* is one (group, row-tile) pair: row tile ``t`` covers rows
``[t*bm, (t+1)*bm)`` and a group that straddles a tile boundary owns a work tile in
each tile it touches. Rows past ``sum(group_sizes)`` form a pseudo-group ``E`` whose
tiles write zeros and read no weights. A group of size 0 owns no work tile, so its
weights are never read. The number of work tiles is at most ``cdiv(M, bm) + min(E, M)``
(static), the rest are padding tiles with an empty row range.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


def _is_pow2(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool) and v >= 1 and not v & (v - 1)


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """Tile sizes of the Triton-style gmm / tgmm kernels (powers of two, >= 16 on GPU).

  A field left ``None`` is the heuristic's choice for the shapes of the call
  (``default_tiling``), so ``TritonConfig()`` is the tuned default and
  ``TritonConfig(split_k=4)`` changes one knob only.

  gmm: ``bm`` rows x ``bn`` output columns (O) per program, reduction over I in ``bk``
  steps, ``split_k`` programs share one reduction (partial sums in f32, added
  afterwards; for decode, where there are too few row tiles to fill the GPU).
  tgmm: out tile ``bk`` (I) x ``bn`` (O) per program, the group's rows in ``bm`` steps.
  ``group_m``: row tiles per band in the L2-friendly program order.
  ``expert_major``: gmm programs ordered work tile by work tile (all of one expert's
  columns and reduction splits together, padding tiles last) instead of the banded
  order: for decode, where the weights are streamed once.
  """
  bm: int | None = None
  bk: int | None = None
  bn: int | None = None
  split_k: int | None = None
  group_m: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  expert_major: bool | None = None

  def __post_init__(self):
    for name in ("bm", "bk", "bn", "split_k", "group_m"):
      v = getattr(self, name)
      if v is not None and not _is_pow2(v):
        raise ValueError(f"TritonConfig.{name} must be a positive power of two, got {v!r}")
    for name in ("num_warps", "num_stages"):
      v = getattr(self, name)
      if v is not None and (not isinstance(v, int) or v < 1):
        raise ValueError(f"TritonConfig.{name} must be a positive int, got {v!r}")
    if self.expert_major is not None and not isinstance(self.expert_major, bool):
      raise ValueError(f"TritonConfig.expert_major must be a bool, got {self.expert_major!r}")

  def resolve(self, m: int, i: int, o: int, e: int, *, op: str = "gmm") -> TritonConfig:
    """This config with every ``None`` field taken from ``default_tiling(m, i, o, e, op=op)``."""
    given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if getattr(self, f.name) is not None}
    if len(given) == len(dataclasses.fields(self)):
      return self
    return dataclasses.replace(default_tiling(m, i, o, e, op=op), **given)


GmmTiling = TritonConfig  # the name callers used before implementations had configs


@dataclasses.dataclass(frozen=True)
class TpuConfig:
  """Block sizes of the TPU gmm / tgmm kernels: ``bm`` rows (a multiple of 8), ``bk`` (I)
  and ``bn`` (O) multiples of the 128-wide lanes. gmm uses ``min(bm, M rounded up to 8)``
  rows (decode: a few rows need no 128-row block); tgmm reading lhs [I, M] has rows on the
  lanes and rounds ``bm`` up to 128."""
  bm: int = 128
  bk: int = 128
  bn: int = 128

  def __post_init__(self):
    for name, mult in (("bm", 8), ("bk", 128), ("bn", 128)):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < mult or v % mult:
        raise ValueError(f"TpuConfig.{name} must be a positive multiple of {mult}, got {v!r}")


def _pow2_at_least(x: int) -> int:
  return 1 << max(0, (int(x) - 1).bit_length())


def default_tiling(m: int, i: int, o: int, e: int, *, op: str = "gmm") -> TritonConfig:
  """A small heuristic: decode (few rows) streams weights, training fills tensor cores.

  gmm: out [m, o], reduction over i ("gmm_quantized": over int8 / int4 codes). tgmm: out
  [e, i, o], reduction over m rows.
  Every field is set. Each choice is a configuration measured on the H200
  (docs/benchmarks.md).
  """
  full = functools.partial(TritonConfig, split_k=1, group_m=8, expert_major=False)
  if op == "tgmm":
    # H200: 575 TFLOP/s on the Mixtral shape (64x128x128/w4: 545); equal on OLMoE.
    return full(bm=64, bk=128, bn=256, num_warps=8, num_stages=3)
  if op == "gmm_quantized" and m <= 64:
    # Decode on int8 / int4 codes (bk counts packed rows). H100, Mixtral w1, 2 / 4 / 32 rows:
    # int4 with 128-row scale groups 38 / 51 / 41 % of the copy rate (the bf16 decode
    # tiling: 26 / 52 / 38 %), int8 (same groups) 48 / 65 / 55 %; no tiling of the sweep
    # reached 70 % (docs/benchmarks.md).
    # Narrow outputs (w_down: O = 4096 is 32 column tiles) split the reduction further, so
    # that the routed experts still give ~450 programs, each >= 4 reduction steps. H100,
    # int4 Mixtral w_down at 2 rows in the decode profile: 58.0 -> 44.8 us (split 2 -> 8).
    split, experts, steps = 2, min(m, e), -(-i // 128)
    while -(-o // 128) * split * experts < 448 and steps // (2 * split) >= 4:
      split *= 2
    return TritonConfig(bm=max(16, _pow2_at_least(m)), bk=128, bn=128, split_k=split,
                        group_m=8, num_warps=4, num_stages=4, expert_major=True)
  if m <= 64:
    # Decode: one row tile (each routed expert read once), expert-major order,
    # I split so that each routed expert is streamed by many programs.
    bm = max(16, _pow2_at_least(m))
    split = 1
    while -(-o // 128) * split < 512 and i // (split * 2) >= 256:
      split *= 2
    if min(m, e) <= 2:  # 1-2 routed experts: narrower tiles, more programs each
      # H200, I=4096 O=14336, 2 rows: 77% of copy bandwidth (bn=128: 68%).
      return TritonConfig(bm=bm, bk=128, bn=64, split_k=split, group_m=8, num_warps=4,
                          num_stages=6, expert_major=True)
    # H200, I=4096 O=14336: 91% (4 rows) and 92% (32 rows) of copy bandwidth.
    split = max(1, split // 2)
    bk = min(256, max(16, _pow2_at_least(-(-i // split))))
    return TritonConfig(bm=bm, bk=bk, bn=128, split_k=split, group_m=8, num_warps=4,
                        num_stages=3, expert_major=True)
  if m <= 2048:
    return full(bm=64, bk=64, bn=128, num_warps=4, num_stages=4)
  if o <= 4096:
    # H200 run 2: OLMoE fwd 559 TFLOP/s balanced, 469 skewed (128x128/w4: 470, 411),
    # OLMoE dlhs 525 (421); Mixtral dlhs ~3.2 ms inferred from run 1's backward total
    # (128x128/w4 measured alone: 3.9-4.0 ms).
    # One contrary reading: OLMoE fwd in run 1, timed first, 241 vs 409 TFLOP/s.
    return full(bm=128, bk=64, bn=256, num_warps=8, num_stages=3)
  # H200, Mixtral w1 (I=4096, O=14336, 16k rows): 711 TFLOP/s, 0.95x the dense einsum.
  return full(bm=128, bk=64, bn=256, num_warps=8, num_stages=3, group_m=16)


class TileMetadata(NamedTuple):
  """Per work tile w (length W = num_work_tiles(...), static), all int32.

  group_W: group id (E = rows past the groups: write zeros).
  mtile_W: row tile index. lo_W / hi_W: the tile's rows are [lo, hi) (empty for padding tiles).
  offsets_E1: [E + 1] row offsets of the groups.
  """
  group_W: jnp.ndarray
  mtile_W: jnp.ndarray
  lo_W: jnp.ndarray
  hi_W: jnp.ndarray
  offsets_E1: jnp.ndarray


def num_work_tiles(m: int, bm: int, e: int, visit_empty: bool = False) -> int:
  """Static bound: each boundary between non-empty (extended) groups adds one tile,
  and there are at most min(E, M) + 1 non-empty ones (the tail included); with
  visit_empty each empty group adds one more tile."""
  return -(-m // bm) + (e if visit_empty else min(e, m))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def make_tile_metadata(group_sizes_E, m: int, bm: int, visit_empty: bool = False
                       ) -> TileMetadata:
  """Work-tile table for rows sorted by group (see module docstring). jnp only, jit-safe.

  Group sizes are clipped so that their sum is at most m. visit_empty: each empty
  group gets one work tile with no rows (tgmm on TPU writes its zero block there).
  """
  e = group_sizes_E.shape[0]
  sizes_E = jnp.maximum(group_sizes_E.astype(jnp.int32), 0)
  ends_E = jnp.minimum(jnp.cumsum(sizes_E), m)
  offsets_E1 = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_E])
  # Extended groups (suffix E1): the E real ones plus the tail [sum, m).
  start_E1 = offsets_E1
  end_E1 = jnp.concatenate([ends_E, jnp.full((1,), m, jnp.int32)])
  nonempty_E1 = end_E1 > start_E1
  first_tile_E1 = start_E1 // bm
  last_tile_E1 = jnp.maximum(end_E1 - 1, 0) // bm
  n_row_tiles = -(-m // bm)
  first_tile_E1 = jnp.minimum(first_tile_E1, n_row_tiles - 1)  # empty groups at the end
  empty_count_E1 = jnp.zeros_like(start_E1)
  if visit_empty:  # real groups only, not the tail
    empty_count_E1 = empty_count_E1.at[:e].set(1)
  count_E1 = jnp.where(nonempty_E1, last_tile_E1 - first_tile_E1 + 1, empty_count_E1)
  cum_E1 = jnp.cumsum(count_E1)
  total = cum_E1[-1]
  w_count = num_work_tiles(m, bm, e, visit_empty)
  w_W = jnp.arange(w_count, dtype=jnp.int32)
  # compare_all: one fused op (the default 'scan' is a device while loop).
  group_W = jnp.searchsorted(cum_E1, w_W, side="right", method="compare_all").astype(jnp.int32)
  valid_W = w_W < total
  # Padding tiles repeat the last real tile (same blocks: no new reads) with no rows.
  last = jnp.maximum(total - 1, 0)
  w_eff_W = jnp.where(valid_W, w_W, last)
  group_W = jnp.where(valid_W, group_W, group_W[last]).astype(jnp.int32)
  group_W = jnp.minimum(group_W, e)
  tile_in_group_W = w_eff_W - (cum_E1 - count_E1)[group_W]
  mtile_W = (first_tile_E1[group_W] + tile_in_group_W).astype(jnp.int32)
  lo_W = jnp.maximum(start_E1[group_W], mtile_W * bm)
  hi_W = jnp.minimum(end_E1[group_W], (mtile_W + 1) * bm)
  lo_W = jnp.where(valid_W, lo_W, 0).astype(jnp.int32)
  hi_W = jnp.where(valid_W, hi_W, 0).astype(jnp.int32)
  return TileMetadata(group_W, mtile_W, lo_W, hi_W, offsets_E1)
