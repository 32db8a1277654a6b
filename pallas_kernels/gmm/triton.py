"""Grouped matmul kernels in the GPU (Triton) style of Pallas; also run with interpret=True on CPU.

Every ref is the whole array; programs index it with dynamic row offsets read from the
work-tile table (plan.py) and mask rows outside their group, so a group of size 0
launches programs that exit at once and reads no weights.
Layouts: lhs [M, I] row-major, rhs [E, I, O] (or [E, O, I] read transposed), out [M, O].
Quantized rhs: int8 codes [E, I, O] or packed int4 [E, I/2, O] plus f32 scales [E, Q, O]
(layout: quant.py), dequantized in registers. Accumulation is float32.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _implementation as impl_lib
from pallas_kernels._implementation import Unsupported
from pallas_kernels.gmm.plan import TritonConfig, default_tiling, make_tile_metadata, num_work_tiles

_DOT_NN = (((1,), (0,)), ((), ()))  # [m, i] x [i, o]
_DOT_NT = (((1,), (1,)), ((), ()))  # [m, i] x [o, i]
_DOT_TN = (((0,), (0,)), ((), ()))  # [m, i] x [m, o] -> [i, o]


def check(interpret: bool, *, quantized: bool = False):
  """Compiles through Pallas' Triton lowering on a GPU only; interprets anywhere."""
  del quantized  # int8 / int4 weights are dequantized in the kernel
  if not interpret and impl_lib.platform() != "gpu":
    raise Unsupported(f"compiles for GPUs only (default device: {impl_lib.platform()}); "
                      "pass interpret=True to interpret it")


def forward_config(config: TritonConfig, m: int, i: int, o: int, e: int, *, interpret: bool,
                   quant_group: int | None = None, quantized: bool = False,
                   op: str = "gmm") -> TritonConfig:
  """The config's unset fields from the heuristic; quantized with scale groups: bk divides
  the group, so that each reduction step uses one row of scales."""
  t = config.resolve(m, i, o, e, op="gmm_quantized" if quantized and op == "gmm" else op)
  if not quantized or quant_group is None:
    return t
  bk = min(t.bk, quant_group & -quant_group)
  if bk < 16 and not interpret:
    raise Unsupported(f"group_size={quant_group} needs a reduction tile of {bk} < 16 rows; "
                      "use a group size divisible by 16")
  return t if bk == t.bk else dataclasses.replace(t, bk=bk)


def backward_configs(m: int, i: int, o: int, e: int) -> tuple[TritonConfig, TritonConfig]:
  """(dlhs gmm: out [m, i] reducing o; drhs tgmm: out [e, i, o]) heuristic configs."""
  return default_tiling(m, o, i, e), default_tiling(m, i, o, e, op="tgmm")


def _swizzle(pid, rows: int, cols: int, group: int):
  """L2-friendly order: bands of `group` row tiles, rows fastest inside a band."""
  per_band = group * cols
  band = pid // per_band
  first = band * group
  band_rows = jnp.minimum(rows - first, group)
  local = pid % per_band
  return first + local % band_rows, local // band_rows


def _compiler_params(t: TritonConfig):
  return pltriton.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)


# bf16 from codes without int-to-float conversions (quarter-rate instructions on Hopper,
# which held int8 / int4 decode to the bf16 kernel's element rate). bf16 has 7 mantissa
# bits: a nibble n ORed under the exponent of 128 reads as 128 + n (a high nibble, shifted
# down by one, as 128 + 8n), and one bf16x2 fma per pair of values removes the offset;
# every step is exact.
_BF16X2 = dict(one="0x3F803F80", two="0x40004000", eighth="0x3E003E00", m136="0xC308C308",
               m24="0xC1C0C1C0", m512="0xC400C400", lo="0x000F000F", hi="0x00780078",
               magic="0x43004300")
# 4 packed int4 bytes ($2) -> low nibbles - 8 ($0, $1) / high nibbles - 8. Two blocks, as
# Pallas takes one result per asm; ptxas merges their common byte spreading.
_INT4_LO_ASM = """{
.reg .b32 t0, t1, one, m136;
mov.b32 one, %(one)s; mov.b32 m136, %(m136)s;
prmt.b32 t0, $2, 0, 0x4140;
prmt.b32 t1, $2, 0, 0x4342;
lop3.b32 $0, t0, %(lo)s, %(magic)s, 0xEA;
lop3.b32 $1, t1, %(lo)s, %(magic)s, 0xEA;
fma.rn.bf16x2 $0, $0, one, m136;
fma.rn.bf16x2 $1, $1, one, m136;
}""" % _BF16X2
_INT4_HI_ASM = """{
.reg .b32 t0, t1, eighth, m24;
mov.b32 eighth, %(eighth)s; mov.b32 m24, %(m24)s;
prmt.b32 t0, $2, 0, 0x4140;
prmt.b32 t1, $2, 0, 0x4342;
shr.b32 t0, t0, 1;
shr.b32 t1, t1, 1;
lop3.b32 $0, t0, %(hi)s, %(magic)s, 0xEA;
lop3.b32 $1, t1, %(hi)s, %(magic)s, 0xEA;
fma.rn.bf16x2 $0, $0, eighth, m24;
fma.rn.bf16x2 $1, $1, eighth, m24;
}""" % _BF16X2
# 4 int8 codes ($2) -> bf16 ($0, $1): u = c + 128 = 16 u_hi + u_lo, and
# c = (128 + u_lo) + (2 (128 + 8 u_hi) - 512); the partial sums are exact in bf16.
_INT8_ASM = """{
.reg .b32 u, t0, t1, s0, s1, h0, h1, one, two, m512;
mov.b32 one, %(one)s; mov.b32 two, %(two)s; mov.b32 m512, %(m512)s;
xor.b32 u, $2, 0x80808080;
prmt.b32 t0, u, 0, 0x4140;
prmt.b32 t1, u, 0, 0x4342;
shr.b32 s0, t0, 1;
shr.b32 s1, t1, 1;
lop3.b32 h0, s0, %(hi)s, %(magic)s, 0xEA;
lop3.b32 h1, s1, %(hi)s, %(magic)s, 0xEA;
lop3.b32 $0, t0, %(lo)s, %(magic)s, 0xEA;
lop3.b32 $1, t1, %(lo)s, %(magic)s, 0xEA;
fma.rn.bf16x2 h0, h0, two, m512;
fma.rn.bf16x2 h1, h1, two, m512;
fma.rn.bf16x2 $0, $0, one, h0;
fma.rn.bf16x2 $1, $1, one, h1;
}""" % _BF16X2


def _dequant_block(codes, *, bits: int, dtype, fast: bool):
  """Codes block -> exact values in `dtype`: [w] for int8, [low nibbles, high nibbles] for
  packed int4. fast: the bf16 inline-PTX form (compiled bf16 kernels only)."""
  if fast:
    asm = pltriton.elementwise_inline_asm
    out = [jax.ShapeDtypeStruct(codes.shape, jnp.bfloat16)]
    blocks = (_INT8_ASM,) if bits == 8 else (_INT4_LO_ASM, _INT4_HI_ASM)
    return [asm(code, args=[codes], constraints="=r,=r,r", pack=4, result_shape_dtypes=out)[0]
            for code in blocks]
  if bits == 8:
    return [codes.astype(jnp.float32).astype(dtype)]
  c = codes.astype(jnp.int32)
  return [((c & 0xF) - 8).astype(jnp.float32).astype(dtype),
          (((c >> 4) & 0xF) - 8).astype(jnp.float32).astype(dtype)]


def _gmm_kernel(group_ref, mtile_ref, lo_ref, hi_ref, lhs_ref, rhs_ref, *rest,
                e: int, i_size: int, o_size: int, t: TritonConfig, w_count: int,
                transpose_rhs: bool, bits: int | None, scale_group: int | None,
                compute_dtype, fast_dequant: bool):
  """One program: work tile w x output columns [o0, o0+bn) x one reduction split."""
  if bits is None:
    (out_ref,) = rest
    scale_ref = None
  else:
    scale_ref, out_ref = rest
  bm, bk, bn = t.bm, t.bk, t.bn
  o_tiles = -(-o_size // bn)
  if t.expert_major:  # grid (o_tiles * split_k, w_count): padding tiles come last
    w = pl.program_id(1)
    ot, split = pl.program_id(0) // t.split_k, pl.program_id(0) % t.split_k
  else:
    w, ot = _swizzle(pl.program_id(0), w_count, o_tiles, t.group_m)
    split = pl.program_id(1)
  g = group_ref[w]
  mt = mtile_ref[w]
  lo = lo_ref[w]
  hi = hi_ref[w]
  r0 = mt * bm
  o0 = ot * bn
  rows = r0 + jnp.arange(bm, dtype=jnp.int32)
  row_ok = (rows >= lo) & (rows < hi)
  cols = o0 + jnp.arange(bn, dtype=jnp.int32)
  col_ok = cols < o_size
  out_mask = row_ok[:, None] & col_ok[None, :]
  out_idx = (pl.ds(r0, bm), pl.ds(o0, bn))
  out_blk = out_ref.at[(split,) + out_idx] if t.split_k > 1 else out_ref.at[out_idx]

  # This split's reduction range, in whole bk steps. Packed int4 rows ip hold
  # I rows ip (low nibble) and ip + I/2 (high nibble).
  i_red = i_size // 2 if bits == 4 else i_size
  steps = -(-(-(-i_red // t.split_k)) // bk)
  i_first = split * steps * bk
  need_i = t.split_k * steps * bk != i_red
  need_o = o_size % bn != 0

  def load_lhs(icol0, ivalid):
    mask = row_ok[:, None] if ivalid is None else row_ok[:, None] & ivalid[None, :]
    x = pltriton.load(lhs_ref.at[pl.ds(r0, bm), pl.ds(icol0, bk)], mask=mask, other=0)
    return x.astype(compute_dtype)

  def load_rhs(ip, ivalid):
    if transpose_rhs:  # rhs [E, O, I]
      blk = rhs_ref.at[g, pl.ds(o0, bn), pl.ds(ip, bk)]
      mask = col_ok[:, None] if ivalid is None else col_ok[:, None] & ivalid[None, :]
    else:
      blk = rhs_ref.at[g, pl.ds(ip, bk), pl.ds(o0, bn)]
      mask = col_ok[None, :] if ivalid is None else ivalid[:, None] & col_ok[None, :]
    if not (need_i or need_o):
      return pltriton.load(blk)
    return pltriton.load(blk, mask=mask, other=0)

  def load_scale(q_idx):
    # A reduction step wholly past I (a split's padding) still scales its zero product:
    # clamp, so that it never reads past the scales (a NaN there would survive 0 * NaN).
    q_idx = jnp.minimum(q_idx, scale_ref.shape[1] - 1)
    return pltriton.load(scale_ref.at[g, q_idx, pl.ds(o0, bn)],
                         mask=col_ok, other=0).astype(jnp.float32)

  @pl.when((hi > lo) & (g < e))
  def _matmul():
    dims = _DOT_NT if transpose_rhs else _DOT_NN

    def body(step, acc):
      ip = i_first + step * bk
      ivalid = (ip + jnp.arange(bk, dtype=jnp.int32) < i_red) if need_i else None
      if bits is None:
        x = load_lhs(ip, ivalid)
        wv = load_rhs(ip, ivalid).astype(compute_dtype)
        return acc + jax.lax.dot_general(x, wv, dims, preferred_element_type=jnp.float32)
      codes = load_rhs(ip, ivalid)
      values = _dequant_block(codes, bits=bits, dtype=compute_dtype, fast=fast_dequant)
      for wv, icol in zip(values, (ip, ip + i_red)):
        x = load_lhs(icol, ivalid)
        part = jax.lax.dot_general(x, wv, dims, preferred_element_type=jnp.float32)
        if scale_group is not None:  # bk divides scale_group: one scale row
          part = part * load_scale(icol // scale_group)[None, :]
        acc = acc + part
      return acc

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
    if bits is not None and scale_group is None:  # per-channel: scale once
      acc = acc * load_scale(jnp.int32(0))[None, :]
    pltriton.store(out_blk, acc.astype(out_ref.dtype), mask=out_mask)

  @pl.when((hi > lo) & (g == e))
  def _zeros():  # rows past sum(group_sizes)
    pltriton.store(out_blk, jnp.zeros((bm, bn), out_ref.dtype), mask=out_mask)


@functools.partial(
    jax.jit,
    static_argnames=("o", "config", "transpose_rhs", "out_dtype", "interpret", "bits",
                     "scale_group"))
def gmm(lhs_MI, rhs, group_sizes_E, scales_EQO=None, *, o: int, config: TritonConfig,
        transpose_rhs: bool, out_dtype, interpret: bool, bits=None, scale_group=None):
  """out [M, o] = grouped lhs @ rhs; rhs [E, I, o] (or [E, o, I] with transpose_rhs).

  ``config``: every field set (``forward_config``). Quantized (bits 8 / 4): rhs holds
  int8 codes [E, I, O] or packed int4 [E, I/2, O] and scales_EQO [E, Q, O] with
  Q = I / scale_group (Q = 1: per output channel).
  """
  m, i = lhs_MI.shape
  e = rhs.shape[0]
  t = config
  meta = make_tile_metadata(group_sizes_E, m, t.bm)
  w_count = num_work_tiles(m, t.bm, e)
  o_tiles = -(-o // t.bn)
  # Quantized codes are exact in lhs's dtype (bf16 / f32).
  compute_dtype = lhs_MI.dtype if bits else jnp.promote_types(lhs_MI.dtype, rhs.dtype)
  kernel = functools.partial(
      _gmm_kernel, e=e, i_size=i, o_size=o, t=t, w_count=w_count,
      transpose_rhs=transpose_rhs, bits=bits, scale_group=scale_group,
      compute_dtype=compute_dtype,
      fast_dequant=bool(bits) and not interpret and compute_dtype == jnp.bfloat16)
  split_dtype = jnp.float32 if t.split_k > 1 else out_dtype
  out_shape = (t.split_k, m, o) if t.split_k > 1 else (m, o)
  args = [meta.group_W, meta.mtile_W, meta.lo_W, meta.hi_W, lhs_MI, rhs]
  if bits is not None:
    args.append(scales_EQO)
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct(out_shape, split_dtype),
      grid=((o_tiles * t.split_k, w_count) if t.expert_major
            else (w_count * o_tiles, t.split_k)),
      compiler_params=None if interpret else _compiler_params(t),
      interpret=interpret,
      name="gmm",
  )(*args)
  if t.split_k > 1:
    out = out.sum(axis=0).astype(out_dtype)
  return out


def _tgmm_kernel(offsets_ref, lhs_ref, rhs_ref, out_ref, *, i_size: int, o_size: int,
                 t: TritonConfig, lhs_im: bool, compute_dtype):
  """One program: group g, out tile [i0:i0+bk, o0:o0+bn], looping over g's rows."""
  bm, bk, bn = t.bm, t.bk, t.bn
  i_tiles, o_tiles = -(-i_size // bk), -(-o_size // bn)
  pid = pl.program_id(0)
  per_group = i_tiles * o_tiles
  g = pid // per_group
  it, ot = _swizzle(pid % per_group, i_tiles, o_tiles, t.group_m)
  i0, o0 = it * bk, ot * bn
  start = offsets_ref[g]
  end = offsets_ref[g + 1]
  i_ok = i0 + jnp.arange(bk, dtype=jnp.int32) < i_size
  o_ok = o0 + jnp.arange(bn, dtype=jnp.int32) < o_size

  def body(step, acc):
    r0 = start + step * bm
    row_ok = r0 + jnp.arange(bm, dtype=jnp.int32) < end
    if lhs_im:
      x = pltriton.load(lhs_ref.at[pl.ds(i0, bk), pl.ds(r0, bm)],
                        mask=i_ok[:, None] & row_ok[None, :], other=0)
      dims = _DOT_NN
    else:
      x = pltriton.load(lhs_ref.at[pl.ds(r0, bm), pl.ds(i0, bk)],
                        mask=row_ok[:, None] & i_ok[None, :], other=0)
      dims = _DOT_TN
    dy = pltriton.load(rhs_ref.at[pl.ds(r0, bm), pl.ds(o0, bn)],
                       mask=row_ok[:, None] & o_ok[None, :], other=0)
    return acc + jax.lax.dot_general(
        x.astype(compute_dtype), dy.astype(compute_dtype), dims,
        preferred_element_type=jnp.float32)

  steps = (end - start + bm - 1) // bm
  acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bk, bn), jnp.float32))
  pltriton.store(out_ref.at[g, pl.ds(i0, bk), pl.ds(o0, bn)], acc.astype(out_ref.dtype),
                 mask=i_ok[:, None] & o_ok[None, :])


@functools.partial(jax.jit, static_argnames=("config", "lhs_im", "out_dtype", "interpret"))
def tgmm(lhs, rhs_MO, group_sizes_E, *, config: TritonConfig, lhs_im: bool, out_dtype,
         interpret: bool):
  """out [E, I, O]: out[g] = lhs[rows of g].T @ rhs[rows of g]; lhs [M, I] or [I, M] (lhs_im).

  ``config``: every field set (``backward_configs`` or ``TritonConfig.resolve(op="tgmm")``).
  """
  i = lhs.shape[0] if lhs_im else lhs.shape[1]
  m, o = rhs_MO.shape
  e, t = group_sizes_E.shape[0], config
  offsets_E1 = make_tile_metadata(group_sizes_E, m, t.bm).offsets_E1
  compute_dtype = jnp.promote_types(lhs.dtype, rhs_MO.dtype)
  kernel = functools.partial(_tgmm_kernel, i_size=i, o_size=o, t=t, lhs_im=lhs_im,
                             compute_dtype=compute_dtype)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((e, i, o), out_dtype),
      grid=(e * -(-i // t.bk) * -(-o // t.bn),),
      compiler_params=None if interpret else _compiler_params(t),
      interpret=interpret,
      name="tgmm",
  )(offsets_E1, lhs, rhs_MO)
