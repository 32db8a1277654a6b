"""Grouped matmul kernels in the GPU (Triton) style of Pallas; also run with interpret=True on CPU.

Every ref is the whole array; programs index it with dynamic row offsets read
from the work-tile table (gmm_plan.py) and mask rows outside their group, so a
group of size 0 launches programs that exit at once and reads no weights.
Layouts: lhs [M, K] row-major, rhs [E, K, N] (or [E, N, K] read transposed),
out [M, N]. Accumulation is float32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.gmm_plan import GmmTiling, TileMetadata, num_work_tiles

_DOT_NN = (((1,), (0,)), ((), ()))  # [m, k] x [k, n]
_DOT_NT = (((1,), (1,)), ((), ()))  # [m, k] x [n, k]
_DOT_TN = (((0,), (0,)), ((), ()))  # [k, m] x [k, n] -> [m, n]


def _swizzle(pid, rows: int, cols: int, group: int):
  """L2-friendly order: bands of `group` row tiles, rows fastest inside a band."""
  per_band = group * cols
  band = pid // per_band
  first = band * group
  band_rows = jnp.minimum(rows - first, group)
  local = pid % per_band
  return first + local % band_rows, local // band_rows


def _compiler_params(t: GmmTiling):
  return pltriton.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)


def _dequant_block(codes, *, bits: int, half: int, dtype):
  """int codes block -> `dtype` values (exact). 4-bit: half 0 = low nibble, 1 = high."""
  if bits == 8:
    return codes.astype(jnp.float32).astype(dtype)
  c = codes.astype(jnp.int32)
  c = (c >> 4) if half else c
  return ((c & 0xF) - 8).astype(jnp.float32).astype(dtype)


def _gmm_kernel(group_ref, mtile_ref, lo_ref, hi_ref, lhs_ref, rhs_ref, *rest,
                e: int, m: int, k: int, n: int, t: GmmTiling, w_count: int,
                transpose_rhs: bool, bits: int | None, scale_group: int | None,
                compute_dtype):
  """One program: work tile w x output columns [n0, n0+bn) x one K split."""
  if bits is None:
    (out_ref,) = rest
    scale_ref = None
  else:
    scale_ref, out_ref = rest
  bm, bk, bn = t.bm, t.bk, t.bn
  n_tiles = -(-n // bn)
  if t.expert_major:  # grid (n_tiles * split_k, w_count): padding tiles come last
    w = pl.program_id(1)
    nt, split = pl.program_id(0) // t.split_k, pl.program_id(0) % t.split_k
  else:
    w, nt = _swizzle(pl.program_id(0), w_count, n_tiles, t.group_m)
    split = pl.program_id(1)
  g = group_ref[w]
  mt = mtile_ref[w]
  lo = lo_ref[w]
  hi = hi_ref[w]
  r0 = mt * bm
  n0 = nt * bn
  rows = r0 + jnp.arange(bm, dtype=jnp.int32)
  row_ok = (rows >= lo) & (rows < hi)
  cols = n0 + jnp.arange(bn, dtype=jnp.int32)
  col_ok = cols < n
  out_mask = row_ok[:, None] & col_ok[None, :]
  out_idx = (pl.ds(r0, bm), pl.ds(n0, bn))
  out_blk = out_ref.at[(split,) + out_idx] if t.split_k > 1 else out_ref.at[out_idx]

  # This split's reduction range, in whole bk steps. Packed int4 rows kp hold
  # K rows kp (low nibble) and kp + K/2 (high nibble).
  k_red = k // 2 if bits == 4 else k
  steps = -(-(-(-k_red // t.split_k)) // bk)
  k_first = split * steps * bk
  need_k = t.split_k * steps * bk != k_red
  need_n = n % bn != 0

  def load_lhs(kcol0, kvalid):
    mask = row_ok[:, None] if kvalid is None else row_ok[:, None] & kvalid[None, :]
    x = pltriton.load(lhs_ref.at[pl.ds(r0, bm), pl.ds(kcol0, bk)], mask=mask, other=0)
    return x.astype(compute_dtype)

  def load_rhs(kp, kvalid):
    if transpose_rhs:  # rhs [E, n, k]
      blk = rhs_ref.at[g, pl.ds(n0, bn), pl.ds(kp, bk)]
      mask = col_ok[:, None] if kvalid is None else col_ok[:, None] & kvalid[None, :]
    else:
      blk = rhs_ref.at[g, pl.ds(kp, bk), pl.ds(n0, bn)]
      mask = col_ok[None, :] if kvalid is None else kvalid[:, None] & col_ok[None, :]
    if not (need_k or need_n):
      return pltriton.load(blk)
    return pltriton.load(blk, mask=mask, other=0)

  def load_scale(group_idx):
    return pltriton.load(scale_ref.at[g, group_idx, pl.ds(n0, bn)],
                         mask=col_ok, other=0).astype(jnp.float32)

  @pl.when((hi > lo) & (g < e))
  def _matmul():
    dims = _DOT_NT if transpose_rhs else _DOT_NN

    def body(i, acc):
      kp = k_first + i * bk
      kvalid = (kp + jnp.arange(bk, dtype=jnp.int32) < k_red) if need_k else None
      if bits is None:
        x = load_lhs(kp, kvalid)
        wv = load_rhs(kp, kvalid).astype(compute_dtype)
        return acc + jax.lax.dot_general(x, wv, dims, preferred_element_type=jnp.float32)
      codes = load_rhs(kp, kvalid)
      halves = ((0, kp),) if bits == 8 else ((0, kp), (1, kp + k_red))
      for half, kcol in halves:
        x = load_lhs(kcol, kvalid)
        wv = _dequant_block(codes, bits=bits, half=half, dtype=compute_dtype)
        part = jax.lax.dot_general(x, wv, dims, preferred_element_type=jnp.float32)
        if scale_group is not None:  # bk divides scale_group: one scale row
          part = part * load_scale(kcol // scale_group)[None, :]
        acc = acc + part
      return acc

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
    if bits is not None and scale_group is None:  # per-channel: scale once
      acc = acc * load_scale(jnp.int32(0))[None, :]
    pltriton.store(out_blk,
                   acc.astype(out_ref.dtype), mask=out_mask)

  @pl.when((hi > lo) & (g == e))
  def _zeros():  # rows past sum(group_sizes)
    pltriton.store(out_blk,
                   jnp.zeros((bm, bn), out_ref.dtype), mask=out_mask)


@functools.partial(
    jax.jit,
    static_argnames=("n", "tiling", "transpose_rhs", "out_dtype", "interpret",
                     "bits", "scale_group"))
def gmm_gpu(lhs_MK, rhs, meta: TileMetadata, scales=None, *, n: int, tiling: GmmTiling,
            transpose_rhs: bool, out_dtype, interpret: bool, bits=None,
            scale_group=None):
  """out[M, n] = grouped lhs @ rhs. rhs [E, K, N] (or [E, N, K] with transpose_rhs).

  Quantized (bits 8/4): rhs holds int8 codes [E, K, N] or packed int4 [E, K/2, N]
  (byte (k, n): low nibble = code of row k, high nibble = row k + K/2; code + 8
  stored), scales [E, G, N] with G = K / scale_group (G = 1: per channel).
  """
  m, k = lhs_MK.shape
  e = rhs.shape[0]
  t = tiling
  w_count = num_work_tiles(m, t.bm, e)
  n_tiles = -(-n // t.bn)
  # Quantized codes are exact in lhs's dtype (bf16 / f32).
  compute_dtype = lhs_MK.dtype if bits else jnp.promote_types(lhs_MK.dtype, rhs.dtype)
  kernel = functools.partial(
      _gmm_kernel, e=e, m=m, k=k, n=n, t=t, w_count=w_count,
      transpose_rhs=transpose_rhs, bits=bits, scale_group=scale_group,
      compute_dtype=compute_dtype)
  split_dtype = jnp.float32 if t.split_k > 1 else out_dtype
  out_shape = (t.split_k, m, n) if t.split_k > 1 else (m, n)
  args = [meta.group_W, meta.mtile_W, meta.lo_W, meta.hi_W, lhs_MK, rhs]
  if bits is not None:
    args.append(scales)
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct(out_shape, split_dtype),
      grid=((n_tiles * t.split_k, w_count) if t.expert_major
            else (w_count * n_tiles, t.split_k)),
      compiler_params=None if interpret else _compiler_params(t),
      interpret=interpret,
      name="gmm",
  )(*args)
  if t.split_k > 1:
    out = out.sum(axis=0).astype(out_dtype)
  return out


def _tgmm_kernel(offsets_ref, lhs_ref, rhs_ref, out_ref, *, e: int, m: int, k: int,
                 n: int, t: GmmTiling, lhs_km: bool, compute_dtype):
  """One program: group g, out tile [k0:k0+bk, n0:n0+bn], looping over g's rows."""
  bm, bk, bn = t.bm, t.bk, t.bn
  k_tiles, n_tiles = -(-k // bk), -(-n // bn)
  pid = pl.program_id(0)
  per_group = k_tiles * n_tiles
  g = pid // per_group
  kt, nt = _swizzle(pid % per_group, k_tiles, n_tiles, t.group_m)
  k0, n0 = kt * bk, nt * bn
  start = offsets_ref[g]
  end = offsets_ref[g + 1]
  ks = k0 + jnp.arange(bk, dtype=jnp.int32)
  ns = n0 + jnp.arange(bn, dtype=jnp.int32)
  k_ok, n_ok = ks < k, ns < n

  def body(i, acc):
    r0 = start + i * bm
    row_ok = r0 + jnp.arange(bm, dtype=jnp.int32) < end
    if lhs_km:
      x = pltriton.load(lhs_ref.at[pl.ds(k0, bk), pl.ds(r0, bm)],
                        mask=k_ok[:, None] & row_ok[None, :], other=0)
      dims = _DOT_NN
    else:
      x = pltriton.load(lhs_ref.at[pl.ds(r0, bm), pl.ds(k0, bk)],
                        mask=row_ok[:, None] & k_ok[None, :], other=0)
      dims = _DOT_TN
    dy = pltriton.load(rhs_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)],
                       mask=row_ok[:, None] & n_ok[None, :], other=0)
    return acc + jax.lax.dot_general(
        x.astype(compute_dtype), dy.astype(compute_dtype), dims,
        preferred_element_type=jnp.float32)

  steps = (end - start + bm - 1) // bm
  acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bk, bn), jnp.float32))
  pltriton.store(out_ref.at[g, pl.ds(k0, bk), pl.ds(n0, bn)], acc.astype(out_ref.dtype),
                 mask=k_ok[:, None] & n_ok[None, :])


@functools.partial(jax.jit, static_argnames=("num_groups", "tiling", "lhs_km", "out_dtype",
                                             "interpret"))
def tgmm_gpu(lhs, rhs_MN, offsets_E1, *, num_groups: int, tiling: GmmTiling, lhs_km: bool,
             out_dtype, interpret: bool):
  """out[g] = lhs[rows of g].T @ rhs[rows of g] -> [E, K, N]. lhs [M, K] or [K, M] (lhs_km)."""
  k = lhs.shape[0] if lhs_km else lhs.shape[1]
  m, n = rhs_MN.shape
  e, t = num_groups, tiling
  compute_dtype = jnp.promote_types(lhs.dtype, rhs_MN.dtype)
  kernel = functools.partial(_tgmm_kernel, e=e, m=m, k=k, n=n, t=t, lhs_km=lhs_km,
                             compute_dtype=compute_dtype)
  grid = (e * -(-k // t.bk) * -(-n // t.bn),)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((e, k, n), out_dtype),
      grid=grid,
      compiler_params=None if interpret else _compiler_params(t),
      interpret=interpret,
      name="tgmm",
  )(offsets_E1, lhs, rhs_MN)
