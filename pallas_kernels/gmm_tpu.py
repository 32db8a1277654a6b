"""TPU-shaped grouped matmul: block specs driven by scalar-prefetched work tiles.

Blocks are (bm, bk) x (bk, bn) -> (bm, bn), multiples of 8 x 128 on a real TPU.
Grid (n tiles, work tiles, k tiles): consecutive work tiles that share a row
tile keep the same output block resident, each writing only its own rows
(masked), so a row tile shared by two groups is written back once. Work tiles
of empty groups do not exist, so their weight blocks are never fetched.
tgmm: grid (k, n, work tiles); empty groups get one empty work tile that
writes their zero block. Float weights only (quantized weights are dequantized
first); tested on CPU with Pallas' TPU interpret mode, not yet on a TPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.gmm_plan import GmmTiling, make_tile_metadata


def _gmm_kernel(group_ref, mtile_ref, lo_ref, hi_ref, lhs_ref, rhs_ref, out_ref, acc_ref, *,
                e: int, k: int, bk: int, k_tiles: int, transpose_rhs: bool):
  w, kk = pl.program_id(1), pl.program_id(2)
  g, lo, hi = group_ref[w], lo_ref[w], hi_ref[w]

  @pl.when(kk == 0)
  def _init():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when((hi > lo) & (g < e))
  def _acc():
    x, wv = lhs_ref[...], rhs_ref[...]
    if k % bk:  # zero the padded K edge of both operands
      cols = kk * bk + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
      x = jnp.where(cols < k, x, 0)
      kdim = 1 if transpose_rhs else 0
      rows = kk * bk + jax.lax.broadcasted_iota(jnp.int32, wv.shape, kdim)
      wv = jnp.where(rows < k, wv, 0)
    dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
    acc_ref[...] += jax.lax.dot_general(x, wv, dims, preferred_element_type=jnp.float32)

  @pl.when(kk == k_tiles - 1)
  def _store():
    bm = out_ref.shape[0]
    rows = mtile_ref[w] * bm + jax.lax.broadcasted_iota(jnp.int32, out_ref.shape, 0)
    mine = (rows >= lo) & (rows < hi)
    val = jnp.where(g < e, acc_ref[...], 0.0).astype(out_ref.dtype)
    out_ref[...] = jnp.where(mine, val, out_ref[...])


def gmm_tpu(lhs_MK, rhs, group_sizes_E, scales=None, *, n: int, tiling: GmmTiling,
            transpose_rhs: bool, out_dtype, bits=None, scale_group=None, interpret=False):
  """out[M, n] = grouped lhs @ rhs; rhs [E, K, n] (or [E, n, K] with transpose_rhs)."""
  if bits is not None:
    raise NotImplementedError("quantized weights: use the GPU/interpret path (gmm_gpu)")
  del scales, scale_group
  m, k = lhs_MK.shape
  e = rhs.shape[0]
  # TPU blocks: rows a multiple of 8, lanes a multiple of 128.
  bm, bk, bn = max(8, tiling.bm), max(128, tiling.bk), max(128, tiling.bn)
  meta = make_tile_metadata(group_sizes_E, m, bm)
  w_count = meta.group_W.shape[0]
  k_tiles, n_tiles = -(-k // bk), -(-n // bn)

  def rhs_map(ni, wi, ki, group, mtile, lo, hi):
    gi = jnp.minimum(group[wi], e - 1)
    return (gi, ni, ki) if transpose_rhs else (gi, ki, ni)

  rhs_block = (None, bn, bk) if transpose_rhs else (None, bk, bn)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=4,
      grid=(n_tiles, w_count, k_tiles),
      in_specs=[
          pl.BlockSpec((bm, bk), lambda ni, wi, ki, group, mtile, lo, hi: (mtile[wi], ki)),
          pl.BlockSpec(rhs_block, rhs_map),
      ],
      out_specs=pl.BlockSpec((bm, bn), lambda ni, wi, ki, group, mtile, lo, hi: (mtile[wi], ni)),
      scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
  )
  kernel = functools.partial(_gmm_kernel, e=e, k=k, bk=bk, k_tiles=k_tiles,
                             transpose_rhs=transpose_rhs)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid_spec=grid_spec,
      compiler_params=None if interpret else pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="gmm_tpu",
  )(meta.group_W, meta.mtile_W, meta.lo_W, meta.hi_W, lhs_MK, rhs)


def _tgmm_kernel(group_ref, mtile_ref, lo_ref, hi_ref, lhs_ref, rhs_ref, out_ref, acc_ref, *,
                 e: int, w_count: int, lhs_km: bool):
  """Work tile w adds its rows' lhs.T @ rhs to its group's [bk, bn] block."""
  w = pl.program_id(2)
  g, lo, hi = group_ref[w], lo_ref[w], hi_ref[w]
  gc = jnp.minimum(g, e - 1)
  prev = jnp.minimum(group_ref[jnp.maximum(w - 1, 0)], e - 1)
  nxt = jnp.minimum(group_ref[jnp.minimum(w + 1, w_count - 1)], e - 1)

  @pl.when((w == 0) | (prev != gc))
  def _init():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when((hi > lo) & (g < e))
  def _acc():
    bm = rhs_ref.shape[0]
    r0 = mtile_ref[w] * bm
    dy = rhs_ref[...]
    rows = r0 + jax.lax.broadcasted_iota(jnp.int32, dy.shape, 0)
    dy = jnp.where((rows >= lo) & (rows < hi), dy, 0)
    x = lhs_ref[...]
    rdim = 1 if lhs_km else 0
    xrows = r0 + jax.lax.broadcasted_iota(jnp.int32, x.shape, rdim)
    x = jnp.where((xrows >= lo) & (xrows < hi), x, 0)  # also clears padded edge garbage
    dims = (((1,), (0,)), ((), ())) if lhs_km else (((0,), (0,)), ((), ()))
    acc_ref[...] += jax.lax.dot_general(x, dy, dims, preferred_element_type=jnp.float32)

  @pl.when((w == w_count - 1) | (nxt != gc))
  def _store():
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def tgmm_tpu(lhs, rhs_MN, group_sizes_E, *, tiling: GmmTiling, lhs_km: bool, out_dtype,
             interpret=False):
  """out[g] = lhs[rows of g].T @ rhs[rows of g] -> [E, K, N]; lhs [M, K] or [K, M] (lhs_km).

  Grid (k tiles, n tiles, work tiles): a group's work tiles are consecutive, so its
  output block stays resident while they accumulate; empty groups get one empty
  work tile (visit_empty) that writes their zero block.
  """
  k = lhs.shape[0] if lhs_km else lhs.shape[1]
  m, n = rhs_MN.shape
  e = group_sizes_E.shape[0]
  # Rows are the lane dim of lhs [K, M]: a multiple of 128 there, of 8 otherwise.
  bm = max(128 if lhs_km else 8, tiling.bm)
  bk, bn = max(128, tiling.bk), max(128, tiling.bn)
  meta = make_tile_metadata(group_sizes_E, m, bm, True)
  w_count = meta.group_W.shape[0]
  if lhs_km:
    lhs_spec = pl.BlockSpec((bk, bm), lambda ki, ni, wi, group, mtile, lo, hi: (ki, mtile[wi]))
  else:
    lhs_spec = pl.BlockSpec((bm, bk), lambda ki, ni, wi, group, mtile, lo, hi: (mtile[wi], ki))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=4,
      grid=(-(-k // bk), -(-n // bn), w_count),
      in_specs=[
          lhs_spec,
          pl.BlockSpec((bm, bn), lambda ki, ni, wi, group, mtile, lo, hi: (mtile[wi], ni)),
      ],
      out_specs=pl.BlockSpec(
          (None, bk, bn),
          lambda ki, ni, wi, group, mtile, lo, hi: (jnp.minimum(group[wi], e - 1), ki, ni)),
      scratch_shapes=[pltpu.VMEM((bk, bn), jnp.float32)],
  )
  kernel = functools.partial(_tgmm_kernel, e=e, w_count=w_count, lhs_km=lhs_km)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((e, k, n), out_dtype),
      grid_spec=grid_spec,
      compiler_params=None if interpret else pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="tgmm_tpu",
  )(meta.group_W, meta.mtile_W, meta.lo_W, meta.hi_W, lhs, rhs_MN)
