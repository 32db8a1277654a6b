"""TPU-shaped grouped matmul: block specs driven by scalar-prefetched work tiles.

Layouts: lhs [M, I], rhs [E, I, O] (or [E, O, I] read transposed), out [M, O]; tgmm
lhs [M, I] or [I, M], rhs [M, O], out [E, I, O]. Float weights only: quantized weights
are Unsupported here (dequantizing first would read more bytes than the float weights;
the "xla" implementation is the honest place for that). Accumulation is float32.

gmm: blocks (bm, bk) x (bk, bn) -> (bm, bn), grid (O tiles, work tiles, I tiles):
consecutive work tiles that share a row tile keep the same output block resident, each
writing only its own rows (masked), so a row tile shared by two groups is written back
once. Work tiles of empty groups do not exist, so their weight blocks are never fetched.
tgmm: grid (I tiles, O tiles, work tiles); empty groups get one empty work tile that
writes their zero block. Tested on CPU with Pallas' TPU interpret mode, not yet on a TPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _implementation as impl_lib
from pallas_kernels._implementation import Unsupported
from pallas_kernels.gmm.plan import TpuConfig, make_tile_metadata


def check(interpret: bool, *, quantized: bool = False):
  """Compiles on a TPU (interprets anywhere with Pallas' TPU interpret mode); float only."""
  if not interpret and impl_lib.platform() != "tpu":
    raise Unsupported(f"compiles for TPUs only (default device: {impl_lib.platform()}); "
                      "pass interpret=True for TPU interpret mode")
  if quantized:
    raise Unsupported("no in-kernel dequantization of QuantizedExpertWeights")


def forward_config(config: TpuConfig, m: int, i: int, o: int, e: int, **_) -> TpuConfig:
  """The config as given (no shape heuristic yet; the kernels shrink bm for few rows)."""
  return config


def backward_configs(m: int, i: int, o: int, e: int) -> tuple[TpuConfig, TpuConfig]:
  """(dlhs gmm, drhs tgmm) configs: the defaults."""
  return TpuConfig(), TpuConfig()


def _round_up(x: int, mult: int) -> int:
  return -(-x // mult) * mult


def _gmm_kernel(group_ref, mtile_ref, lo_ref, hi_ref, lhs_ref, rhs_ref, out_ref, acc_ref, *,
                e: int, i_size: int, bk: int, i_tiles: int, transpose_rhs: bool):
  w, ii = pl.program_id(1), pl.program_id(2)
  g, lo, hi = group_ref[w], lo_ref[w], hi_ref[w]

  @pl.when(ii == 0)
  def _init():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when((hi > lo) & (g < e))
  def _acc():
    x, wv = lhs_ref[...], rhs_ref[...]
    if i_size % bk:  # zero the padded I edge of both operands
      cols = ii * bk + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
      x = jnp.where(cols < i_size, x, 0)
      idim = 1 if transpose_rhs else 0
      rows = ii * bk + jax.lax.broadcasted_iota(jnp.int32, wv.shape, idim)
      wv = jnp.where(rows < i_size, wv, 0)
    dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
    acc_ref[...] += jax.lax.dot_general(x, wv, dims, preferred_element_type=jnp.float32)

  @pl.when(ii == i_tiles - 1)
  def _store():
    bm = out_ref.shape[0]
    rows = mtile_ref[w] * bm + jax.lax.broadcasted_iota(jnp.int32, out_ref.shape, 0)
    mine = (rows >= lo) & (rows < hi)
    val = jnp.where(g < e, acc_ref[...], 0.0).astype(out_ref.dtype)
    out_ref[...] = jnp.where(mine, val, out_ref[...])


@functools.partial(
    jax.jit,
    static_argnames=("o", "config", "transpose_rhs", "out_dtype", "interpret", "bits",
                     "scale_group"))
def gmm(lhs_MI, rhs, group_sizes_E, scales_EQO=None, *, o: int, config: TpuConfig,
        transpose_rhs: bool, out_dtype, interpret: bool, bits=None, scale_group=None):
  """out [M, o] = grouped lhs @ rhs; rhs [E, I, o] (or [E, o, I] with transpose_rhs)."""
  if bits is not None:
    raise Unsupported("no in-kernel dequantization of QuantizedExpertWeights")
  del scales_EQO, scale_group
  m, i = lhs_MI.shape
  e = rhs.shape[0]
  bm, bk, bn = min(config.bm, _round_up(m, 8)), config.bk, config.bn
  meta = make_tile_metadata(group_sizes_E, m, bm)
  w_count = meta.group_W.shape[0]
  i_tiles, o_tiles = -(-i // bk), -(-o // bn)

  def rhs_map(oi, wi, ii, group, mtile, lo, hi):
    gi = jnp.minimum(group[wi], e - 1)
    return (gi, oi, ii) if transpose_rhs else (gi, ii, oi)

  rhs_block = (None, bn, bk) if transpose_rhs else (None, bk, bn)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=4,
      grid=(o_tiles, w_count, i_tiles),
      in_specs=[
          pl.BlockSpec((bm, bk), lambda oi, wi, ii, group, mtile, lo, hi: (mtile[wi], ii)),
          pl.BlockSpec(rhs_block, rhs_map),
      ],
      out_specs=pl.BlockSpec((bm, bn), lambda oi, wi, ii, group, mtile, lo, hi: (mtile[wi], oi)),
      scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
  )
  kernel = functools.partial(_gmm_kernel, e=e, i_size=i, bk=bk, i_tiles=i_tiles,
                             transpose_rhs=transpose_rhs)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((m, o), out_dtype),
      grid_spec=grid_spec,
      compiler_params=None if interpret else pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="gmm_tpu",
  )(meta.group_W, meta.mtile_W, meta.lo_W, meta.hi_W, lhs_MI, rhs)


def _tgmm_kernel(group_ref, mtile_ref, lo_ref, hi_ref, lhs_ref, rhs_ref, out_ref, acc_ref, *,
                 e: int, w_count: int, lhs_im: bool):
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
    rdim = 1 if lhs_im else 0
    xrows = r0 + jax.lax.broadcasted_iota(jnp.int32, x.shape, rdim)
    x = jnp.where((xrows >= lo) & (xrows < hi), x, 0)  # also clears padded edge garbage
    dims = (((1,), (0,)), ((), ())) if lhs_im else (((0,), (0,)), ((), ()))
    acc_ref[...] += jax.lax.dot_general(x, dy, dims, preferred_element_type=jnp.float32)

  @pl.when((w == w_count - 1) | (nxt != gc))
  def _store():
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("config", "lhs_im", "out_dtype", "interpret"))
def tgmm(lhs, rhs_MO, group_sizes_E, *, config: TpuConfig, lhs_im: bool, out_dtype,
         interpret: bool):
  """out [E, I, O]: out[g] = lhs[rows of g].T @ rhs[rows of g]; lhs [M, I] or [I, M] (lhs_im).

  A group's work tiles are consecutive, so its output block stays resident while they
  accumulate; empty groups get one empty work tile (visit_empty) that writes zeros.
  """
  i = lhs.shape[0] if lhs_im else lhs.shape[1]
  m, o = rhs_MO.shape
  e = group_sizes_E.shape[0]
  bm = min(config.bm, _round_up(m, 8))
  if lhs_im:  # rows are the lane dim of lhs [I, M]
    bm = _round_up(bm, 128)
  bk, bn = config.bk, config.bn
  meta = make_tile_metadata(group_sizes_E, m, bm, True)
  w_count = meta.group_W.shape[0]
  if lhs_im:
    lhs_spec = pl.BlockSpec((bk, bm), lambda ii, oi, wi, group, mtile, lo, hi: (ii, mtile[wi]))
  else:
    lhs_spec = pl.BlockSpec((bm, bk), lambda ii, oi, wi, group, mtile, lo, hi: (mtile[wi], ii))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=4,
      grid=(-(-i // bk), -(-o // bn), w_count),
      in_specs=[
          lhs_spec,
          pl.BlockSpec((bm, bn), lambda ii, oi, wi, group, mtile, lo, hi: (mtile[wi], oi)),
      ],
      out_specs=pl.BlockSpec(
          (None, bk, bn),
          lambda ii, oi, wi, group, mtile, lo, hi: (jnp.minimum(group[wi], e - 1), ii, oi)),
      scratch_shapes=[pltpu.VMEM((bk, bn), jnp.float32)],
  )
  kernel = functools.partial(_tgmm_kernel, e=e, w_count=w_count, lhs_im=lhs_im)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((e, i, o), out_dtype),
      grid_spec=grid_spec,
      compiler_params=None if interpret else pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="tgmm_tpu",
  )(meta.group_W, meta.mtile_W, meta.lo_W, meta.hi_W, lhs, rhs_MO)
