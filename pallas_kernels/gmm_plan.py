"""How a grouped matmul is split into tiles: tile sizes and per-tile group metadata.

The rows of ``lhs`` are sorted by group (expert). A *work tile* is one
(group, row-tile) pair: row tile ``t`` covers rows ``[t*bm, (t+1)*bm)`` and a
group that straddles a tile boundary owns a work tile in each tile it touches.
Rows past ``sum(group_sizes)`` form a pseudo-group ``E`` whose tiles write
zeros and read no weights. A group of size 0 owns no work tile, so its weights
are never read. The number of work tiles is at most ``cdiv(M, bm) + min(E, M)``
(static), the rest are padding tiles with an empty row range.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class GmmTiling:
  """Tile sizes of the gmm / tgmm kernels (powers of two, >= 16 on GPU).

  gmm: ``bm`` rows x ``bn`` output columns per program, reduction in ``bk``
  steps, ``split_k`` programs share one reduction (partial sums in f32, added
  afterwards; for decode, where there are too few row tiles to fill the GPU).
  tgmm: out tile ``bk`` x ``bn`` per program, the group's rows in ``bm`` steps.
  ``group_m``: row tiles per band in the L2-friendly program order.
  ``expert_major``: gmm programs ordered work tile by work tile (all of one
  expert's columns and K splits together, padding tiles last) instead of the
  banded order: for decode, where the weights are streamed once.
  """
  bm: int = 128
  bk: int = 64
  bn: int = 128
  split_k: int = 1
  group_m: int = 8
  num_warps: int = 4
  num_stages: int = 3
  expert_major: bool = False

  def __post_init__(self):
    for name in ("bm", "bk", "bn", "split_k", "group_m"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 1 or v & (v - 1):
        raise ValueError(f"GmmTiling.{name} must be a positive power of two, got {v!r}")


def _pow2_at_least(x: int) -> int:
  return 1 << max(0, (int(x) - 1).bit_length())


def default_tiling(m: int, k: int, n: int, e: int, *, op: str = "gmm") -> GmmTiling:
  """A small heuristic: decode (few rows) streams weights, training fills tensor cores.

  gmm: out [m, n], reduction k. tgmm: out [e, k, n], reduction over m rows.
  Each choice is a configuration measured on the H200 (docs/benchmarks.md).
  """
  if op == "tgmm":
    # H200: 575 TFLOP/s on the Mixtral shape (64x128x128/w4: 545); equal on OLMoE.
    return GmmTiling(bm=64, bk=128, bn=256, num_warps=8, num_stages=3)
  if m <= 64:
    # Decode: one row tile (each routed expert read once), expert-major order,
    # K split so that each routed expert is streamed by many programs.
    bm = max(16, _pow2_at_least(m))
    split = 1
    while -(-n // 128) * split < 512 and k // (split * 2) >= 256:
      split *= 2
    if min(m, e) <= 2:  # 1-2 routed experts: narrower tiles, more programs each
      # H200, K=4096 N=14336, 2 rows: 77% of copy bandwidth (bn=128: 68%).
      return GmmTiling(bm=bm, bk=128, bn=64, split_k=split, num_warps=4, num_stages=6,
                       expert_major=True)
    # H200, K=4096 N=14336: 91% (4 rows) and 92% (32 rows) of copy bandwidth.
    split = max(1, split // 2)
    bk = min(256, max(16, _pow2_at_least(-(-k // split))))
    return GmmTiling(bm=bm, bk=bk, bn=128, split_k=split, num_warps=4, num_stages=3,
                     expert_major=True)
  if m <= 2048:
    return GmmTiling(bm=64, bk=64, bn=128, num_warps=4, num_stages=4)
  if n <= 4096:
    # H200 run 2: OLMoE fwd 559 TFLOP/s balanced, 469 skewed (128x128/w4: 470, 411),
    # OLMoE dlhs 525 (421); Mixtral dlhs ~3.2 ms inferred from run 1's backward total
    # (128x128/w4 measured alone: 3.9-4.0 ms).
    # One contrary reading: OLMoE fwd in run 1, timed first, 241 vs 409 TFLOP/s.
    return GmmTiling(bm=128, bk=64, bn=256, num_warps=8, num_stages=3)
  # H200, Mixtral w1 (K=4096, N=14336, 16k rows): 711 TFLOP/s, 0.95x the dense einsum.
  return GmmTiling(bm=128, bk=64, bn=256, num_warps=8, num_stages=3, group_m=16)


class TileMetadata(NamedTuple):
  """Per work tile w (length W = cdiv(M, bm) + E, static).

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
  # Extended groups: the E real ones plus the tail [sum, m).
  start_G = offsets_E1
  end_G = jnp.concatenate([ends_E, jnp.full((1,), m, jnp.int32)])
  nonempty_G = end_G > start_G
  first_tile_G = start_G // bm
  last_tile_G = jnp.maximum(end_G - 1, 0) // bm
  n_row_tiles = -(-m // bm)
  first_tile_G = jnp.minimum(first_tile_G, n_row_tiles - 1)  # empty groups at the end
  empty_count = jnp.zeros_like(start_G)
  if visit_empty:  # real groups only, not the tail
    empty_count = empty_count.at[:e].set(1)
  count_G = jnp.where(nonempty_G, last_tile_G - first_tile_G + 1, empty_count)
  cum_G = jnp.cumsum(count_G)
  total = cum_G[-1]
  w_count = num_work_tiles(m, bm, e, visit_empty)
  w_W = jnp.arange(w_count, dtype=jnp.int32)
  # compare_all: one fused op (the default 'scan' is a device while loop).
  group_W = jnp.searchsorted(cum_G, w_W, side="right", method="compare_all").astype(jnp.int32)
  valid_W = w_W < total
  # Padding tiles repeat the last real tile (same blocks: no new reads) with no rows.
  last = jnp.maximum(total - 1, 0)
  w_eff_W = jnp.where(valid_W, w_W, last)
  group_W = jnp.where(valid_W, group_W, group_W[last]).astype(jnp.int32)
  group_W = jnp.minimum(group_W, e)
  tile_in_group_W = w_eff_W - (cum_G - count_G)[group_W]
  mtile_W = (first_tile_G[group_W] + tile_in_group_W).astype(jnp.int32)
  lo_W = jnp.maximum(start_G[group_W], mtile_W * bm)
  hi_W = jnp.minimum(end_G[group_W], (mtile_W + 1) * bm)
  lo_W = jnp.where(valid_W, lo_W, 0).astype(jnp.int32)
  hi_W = jnp.where(valid_W, hi_W, 0).astype(jnp.int32)
  return TileMetadata(group_W, mtile_W, lo_W, hi_W, offsets_E1)
