"""Shared-memory staging of the Mosaic GPU decode kernel: the query operand built from the
raw queries, each tile's outlier values as fp16, and the per-slot scale multipliers of
in-place codes. Each runs once per program or once per tile, every thread a share."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref

from pallas_kernels.decode_attention.mosaic_gpu_ptx import (
    as_index, const_i32, swizzled_col, to_index, transforms)


def slot_exponent(x, *, unit, exps):
  """MLIR: ``exps[(x // unit) % len(exps)]`` for an i32 flat element index ``x`` (the
  exponents, < 16, packed 4 bits per slot into one i32 constant; at most 8 slots)."""
  assert len(exps) <= 8 and all(0 <= e < 16 for e in exps)
  table = sum(e << (4 * j) for j, e in enumerate(exps))
  table -= (1 << 32) if table >= 1 << 31 else 0
  slot = arith.remui(arith.divui(x, const_i32(unit)), const_i32(len(exps)))
  return arith.andi(arith.shrui(const_i32(table), arith.muli(slot, const_i32(4))), const_i32(15))


POW2_FORMAT = {jnp.dtype(jnp.float16): (16, 15, 10), jnp.dtype(jnp.bfloat16): (16, 127, 7),
                jnp.dtype(jnp.float8_e4m3fn): (8, 7, 3)}     # bits, exponent bias, mantissa bits


def fill_slot_multipliers(dst_ref, *, unit, exps):
  """In-place codes: ``dst`` (the metadata's dtype, so it loads in the metadata's
  register layout; any contiguous shape, n elements) element ``e`` = ``2**exps[j]``
  (exact in fp8 too) of its slot ``j = (e // unit) % cpw`` (``read_plan``): a tile's
  staged scales are then one whole-array multiply (row-by-row or slot-by-slot slices cost
  a warpgroup barrier each: 88 per tile at 2 bits). Written once per program."""
  width, bias, mant = POW2_FORMAT[jnp.dtype(dst_ref.dtype)]

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def fn(ctx, dst):
    del ctx
    ty = ir.MemRefType(dst.type)
    n, iw = int(np.prod(ty.shape)), ir.IntegerType.get_signless(width)
    tid = arith.andi(mgpu_utils.thread_idx(), const_i32(127))
    ptr = mgpu_utils.memref_ptr(dst)
    for i in range(-(-n // 128)):
      e = arith.minui(arith.addi(tid, const_i32(128 * i)), const_i32(n - 1))    # repeats write alike
      exp = slot_exponent(e, unit=unit, exps=exps)
      bits = arith.shli(arith.addi(exp, const_i32(bias)), const_i32(mant))       # 2**exp
      llvm.store(arith.trunci(iw, bits), mgpu_utils.getelementptr(ptr, [e], iw))
  fn(dst_ref)


def stage_outliers(src_ref, dst_ref, *, tokens_major, base=0):
  """A tile's 16-bit outlier values ``src [n, T // C, C]`` (bf16, token-minor) -> fp16 in
  ``dst``, once per tile, so that patching an MMA register costs one 32-bit shared load and
  one select. ``tokens_major``: ``dst [T, W]`` with outlier ``o`` of token ``t`` at
  ``[t, base + o]`` (keys: a thread's two neighbouring channels are then adjacent); else
  ``dst [n, T // C, C]`` as ``src`` (values: a thread's two neighbouring tokens are). Each
  thread converts every 128th token, all ``n`` outliers of it."""
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
  def fn(ctx, src, dst):
    del ctx
    n, nc, c = ir.MemRefType(src.type).shape
    t_all = nc * c
    f16, f32 = ir.F16Type.get(), ir.F32Type.get()
    tid = arith.andi(mgpu_utils.thread_idx(), const_i32(127))
    for i in range(-(-t_all // 128)):
      t = arith.minui(arith.addi(tid, const_i32(128 * i)), const_i32(t_all - 1))   # repeats write alike
      ti = [to_index(arith.divui(t, const_i32(c))), to_index(arith.remui(t, const_i32(c)))]
      for o in range(n):
        x = arith.truncf(f16, arith.extf(f32, memref.load(src, [as_index(o)] + ti)))
        memref.store(x, dst, [to_index(t), as_index(base + o)] if tokens_major else [as_index(o)] + ti)
  fn(src_ref, dst_ref)


def stage_query(raw_ref, idx_ref, dst_ref, *, dp, d_low, scale):
  """The score MMA's query operand, built in the kernel from the raw queries (no XLA
  kernels before it): ``raw [g, D]`` (smem, any float dtype) and the key outlier channels
  ``idx [n_out]`` (global memory, any order) -> ``dst [npad, D_pad]`` fp16 (swizzled as
  the MMA reads it), row ``n < g``, column ``c``: ``scale`` times query channel
  ``split[c]``: the c-th non-outlier channel (ascending) for ``c < d_low``, outlier
  ``c - d_low`` up to ``d_low + n_out``; zeros elsewhere (as ``quantized_partials`` builds
  it in XLA). Each thread writes every 128th element."""
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(transforms(dp, 2))))
  def fn(ctx, raw, idx, dst):
    del ctx
    f32, f16 = ir.F32Type.get(), ir.F16Type.get()
    g, d = ir.MemRefType(raw.type).shape
    n_out = ir.MemRefType(idx.type).shape[0] if d_low < d else 0
    npad = ir.MemRefType(dst.type).shape[0] * 8
    tid = arith.andi(mgpu_utils.thread_idx(), const_i32(127))
    ids = [memref.load(idx, [as_index(k)]) for k in range(n_out)]           # i32
    # t_k: non-outlier channels below outlier k; the j-th non-outlier is j + #{k: t_k <= j}
    ts = []
    for k in range(n_out):
      below = const_i32(0)
      for m in range(n_out):
        lt = arith.cmpi(arith.CmpIPredicate.slt, ids[m], ids[k])
        below = arith.addi(below, arith.extui(ir.IntegerType.get_signless(32), lt))
      ts.append(arith.subi(ids[k], below))
    for e in range(npad * dp // 128):
      flat = arith.addi(tid, const_i32(128 * e))
      n, c = arith.divui(flat, const_i32(dp)), arith.remui(flat, const_i32(dp))
      src = c
      for t in ts:
        le = arith.cmpi(arith.CmpIPredicate.sle, t, c)
        src = arith.addi(src, arith.extui(ir.IntegerType.get_signless(32), le))
      for k in range(n_out):
        src = arith.select(arith.cmpi(arith.CmpIPredicate.eq, c, const_i32(d_low + k)), ids[k], src)
      valid = arith.andi(arith.cmpi(arith.CmpIPredicate.ult, n, const_i32(g)),
                         arith.cmpi(arith.CmpIPredicate.ult, c, const_i32(d_low + n_out)))
      x = memref.load(raw, [to_index(arith.minui(n, const_i32(g - 1))), to_index(arith.minui(src, const_i32(d - 1)))])
      x = arith.mulf(x if x.type == f32 else arith.extf(f32, x), arith.constant(f32, scale))
      x = arith.select(valid, arith.truncf(f16, x), arith.constant(f16, 0.0))
      memref.store(x, dst, [to_index(arith.shrui(n, const_i32(3))), to_index(arith.shrui(c, const_i32(6))),
                            to_index(arith.andi(n, const_i32(7))), to_index(swizzled_col(n, c))])
  fn(raw_ref, idx_ref, dst_ref)
