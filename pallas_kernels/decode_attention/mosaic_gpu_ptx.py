"""Register-level helpers of the Mosaic GPU decode kernel: MLIR scalars, inline PTX for
the dequantization, and one warp's ``mma.sync`` on fragments of the WGMMA layout.

The WGMMA register layout of a ``[64, N]`` array is four stacked m16n8 fragments, one per
warp: thread ``32 w + 4 g + t`` holds rows ``16 w + g`` (+ 8: the "half") and columns
``8 k + 2 t`` (+ 1) of register tile ``k``. A warp's rows of a key tile are then an
``mma.sync`` A operand as they stand, which is what ``warp_scores`` and ``warp_pv`` use.

Dequantization: a code c of b bits becomes fp16 by placing it in the mantissa of 1.0
(v = 1 + c * 2**-b, exact), then x = v * s2 + z2 with s2 = s * 2**b and z2 = z - s2 (one
fma). One 32-bit register holds the uint16 code words of two neighbouring channels, so
three instructions (rotate, lop3, fma.f16x2) make two fp16 values; codes already at their
bit position need no rotate (``read_plan``).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref, vector

from pallas_kernels.kv import layout as kl

SLOT = kl.PACK_STRIDE      # 64 tokens per code slot = M of the key MMA


def const_i32(x):
  return arith.constant(ir.IntegerType.get_signless(32), x)


def to_index(x_i32):
  return arith.index_cast(ir.IndexType.get(), x_i32)


def as_index(x):
  """int or index Value -> index Value."""
  return arith.constant(ir.IndexType.get(), x) if isinstance(x, int) else x


def affine(base, coef, var, div=1, cap=None):
  """(base + coef * var) // div, optionally min(., cap): index arithmetic in MLIR."""
  v = arith.addi(as_index(base), arith.muli(as_index(coef), var))
  if div != 1:
    v = arith.divui(v, as_index(div))
  return v if cap is None else arith.minui(v, as_index(cap))


def in_range(x_i32, lo, hi):
  """lo <= x < hi and clamp(x - lo, 0, hi - lo - 1) (i32 values)."""
  ge = arith.cmpi(arith.CmpIPredicate.sge, x_i32, const_i32(lo))
  lt = arith.cmpi(arith.CmpIPredicate.slt, x_i32, const_i32(hi))
  off = arith.minsi(arith.maxsi(arith.subi(x_i32, const_i32(lo)), const_i32(0)), const_i32(hi - lo - 1))
  return arith.andi(ge, lt), off


def as_i32(x):
  return mgpu_utils.bitcast(x, ir.IntegerType.get_signless(32))


def vec2(ty, elems):
  """vector<2 x ty> from two scalars (insertions into undef, as Mosaic builds its vectors)."""
  v = llvm.mlir_undef(ir.VectorType.get((2,), ty))
  for e, x in enumerate(elems):
    v = vector.insert(x, v, dynamic_position=[], static_position=[e])
  return v


def swizzled(minor_bytes):
  sw = next(s for s in (128, 64, 32) if minor_bytes % s == 0)
  return sw


def transforms(minor_elems, itemsize):
  sw = swizzled(minor_elems * itemsize)
  return (plgpu.TilingTransform((8, sw // itemsize)), plgpu.SwizzleTransform(sw))


def chunk(tile_tokens):
  """Tokens per TMA box of the token-minor arrays: <= 256 and dividing the tile."""
  return next(c for c in (256, 128, 64) if tile_tokens % c == 0)


def swizzled_col(row, col):
  """Column inside a 128-byte-swizzled (8, 64) fp16 tile: the 16-byte chunk ``col // 8`` of
  row ``row`` sits at chunk ``(col // 8) ^ (row % 8)`` (i32 in, i32 out)."""
  chunk = arith.xori(arith.shrui(arith.andi(col, const_i32(63)), const_i32(3)), arith.andi(row, const_i32(7)))
  return arith.ori(arith.shli(chunk, const_i32(3)), arith.andi(col, const_i32(7)))


def meta_pair(s, z, bits):
  """Metadata (fp8/bf16/fp16) -> fp16 (s * 2**bits, z - s * 2**bits): x = v * s2 + z2
  for v = 1 + code * 2**-bits. Both in fp16: 2**bits is exact, the subtraction is
  rounded once (as the Triton kernel does it in float32 and then rounds)."""
  s16, z16 = s.astype(jnp.float16), z.astype(jnp.float16)
  s2 = s16 * jnp.float16(1 << bits)
  return s2, z16 - s2


def dequant_asm(bits, slot):
  """Two fp16 from the uint16 words of two neighbouring channels (one 32-bit register):
  rotate slot ``slot``'s codes to the top mantissa bits of both halves, mask, OR in 1.0
  (lop3), then ``v * s2 + z2`` (fma.f16x2). Three instructions per pair."""
  top = ((1 << bits) - 1) << (10 - bits)
  rot = (slot * bits - (10 - bits)) % 32
  return ("{ .reg .b32 t; "
          f"shf.r.wrap.b32 t, $1, $1, {rot}; "
          f"lop3.b32 t, t, {top | (top << 16):#010x}, 0x3c003c00, 0xea; "
          "fma.rn.f16x2 $0, t, $2, $3; }")


def dequant_asm_at(bits, pos):
  """As ``dequant_asm`` for codes already at bits ``[pos, pos + bits)`` of both halves
  (in-place codes): lop3 and fma, no rotation. v = 1 + code * 2**(pos - 10), so the
  staged scale must be ``s * 2**(10 - pos)`` (``read_plan``)."""
  mask = ((1 << bits) - 1) << pos
  return ("{ .reg .b32 t; "
          f"lop3.b32 t, $1, {mask * 0x10001:#010x}, 0x3c003c00, 0xea; "
          "fma.rn.f16x2 $0, t, $2, $3; }")


def read_plan(bits, cpw):
  """In-place codes (group sizes up to one slot): for each slot ``j`` of a tile,
  ``(rotation to apply to the code words before reading it, 0 for none; the bit position
  its codes then sit at)``. Slot j's codes start at bit ``bits * j`` of each 16-bit half;
  a rotation right by R of the 32-bit register moves them to ``bits * j - R`` in both
  halves. They are read at positions ``[lo, 10 - bits]``, ``lo = min(4, 10 - bits)``:
  inside the mantissa, with a multiplier ``2**(10 - pos) <= max(64, 2**bits)``, so that
  rounding ``z - s * 2**(10 - pos)`` to fp16 costs at most 1/32 of a quantization step
  (plus ``|z| / 2048``; the rotate-to-the-top form: 2**bits / 2048 of a step). Each
  rotation places the next slot at ``lo`` and serves the slots after it while they fit:
  at 2 bits three rotations per eight slots instead of seven."""
  lo, hi = min(4, 10 - bits), 10 - bits
  plan, rot = {}, 0
  for j in range(cpw):
    pos = (bits * j - rot) % 32
    delta = 0
    if not lo <= pos <= hi:
      new = (bits * j - lo) % 32
      delta, rot, pos = (new - rot) % 32, new, lo
    plan[j] = (delta, pos)
  return plan


def rotate_words(words, r):
  """uint16 code words [M, N] (WGMMA layout), each 32-bit register rotated right by r."""
  wl = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=(wl,), return_type=plgpu.ShapeDtypeStruct(words.shape, words.dtype, wl))
  def fn(ctx, w):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    out = w.registers.copy()
    for idx in np.ndindex(out.shape):
      x = mgpu_utils.bitcast(out[idx], i32)
      y = llvm.inline_asm(i32, [x], f"shf.r.wrap.b32 $0, $1, $1, {r};", "=r,r")
      out[idx] = mgpu_utils.bitcast(y, w.registers[idx].type)
    return mgpu.FragmentedArray(_registers=out, _layout=mgpu.WGMMA_LAYOUT, _is_signed=False)
  return fn(words)


def dequant(words, meta_ref, *, bits, slot, meta_index, patch_ref=None, patch=None,
            pos=None, meta_key=None):
  """uint16 code words [M, N] (WGMMA layout) -> fp16 [M, N] (WGMMA layout), in registers.

  meta_ref: shared memory ``f16[2, ...]`` holding ``s2 = s * 2**bits`` (``[0]``) and
  ``z2 = z - s2`` (``[1]``), staged once per tile (``pos``, for in-place codes: the
  codes already sit at bits ``[pos, pos + bits)`` and s2 = s * 2**(10 - pos); no
  rotation). ``meta_index(mt, k, warp, quad)``
  gives the indices (into ``meta_ref[0]``) of the f16 pair that scales the two
  columns a thread holds in register tile ``(mt, k)``: in the WGMMA layout, thread
  ``32 * warp + 4 * r + quad`` holds rows ``64 mt + 16 warp + r (+ 8)`` and columns
  ``8 k + 2 quad (+ 1)``. Each thread loads only the metadata of its own rows (one
  32-bit shared load per pair of columns), so a group boundary between warps costs
  nothing.

  ``meta_key(mt, k, half)`` (optional): registers with equal keys share one metadata pair,
  ``meta_index(mt, k, warp, quad, half)`` then gets the row half too (the per-warp MMA's
  transposed values: the halves are different tokens).

  ``patch(mt, k, half, value_i32, patch_ref, row, quad)`` (optional) may replace the
  two fp16 values of a register (as an i32) by others read from ``patch_ref``; it
  returns None for registers it leaves alone. ``row = 16 warp + r`` and ``quad``
  are the thread's position (i32).
  """
  shape = words.shape
  wl = plgpu.Layout.WGMMA

  refs = (meta_ref,) if patch is None else (meta_ref, patch_ref)

  @plgpu.inline_mgpu(arg_types=(wl,) + (plgpu.RefType(),) * len(refs),
                     return_type=plgpu.ShapeDtypeStruct(shape, jnp.float16, wl))
  def fn(ctx, w, mref, *pref):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    index = ir.IndexType.get()
    f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
    tid = mgpu_utils.thread_idx()
    warp_i32 = arith.andi(arith.shrui(tid, const_i32(5)), const_i32(3))
    warp = to_index(warp_i32)
    quad_i32 = arith.andi(tid, const_i32(3))
    quad = to_index(quad_i32)
    asm = dequant_asm(bits, slot) if pos is None else dequant_asm_at(bits, pos)
    regs = w.registers
    out = regs.copy()
    meta = {}
    if patch is not None:
      row = arith.addi(arith.muli(warp_i32, const_i32(16)),
                       arith.shrui(arith.andi(tid, const_i32(31)), const_i32(2)))
    for idx in np.ndindex(regs.shape):
      mt, k = idx[0], idx[1]
      key = (mt, k) if meta_key is None else meta_key(mt, k, idx[4])
      if key not in meta:
        ii = (meta_index(mt, k, warp, quad) if meta_key is None
              else meta_index(mt, k, warp, quad, idx[4]))
        meta[key] = [mgpu_utils.bitcast(vector.load(f16x2, mref, [arith.constant(index, a)] + ii), i32)
                     for a in (0, 1)]
      w32 = mgpu_utils.bitcast(regs[idx], i32)
      s2, z2 = meta[key]
      r = llvm.inline_asm(i32, [w32, s2, z2], asm, "=r,r,r,r")
      if patch is not None:
        patched = patch(idx[0], idx[1], idx[4], r, pref[0], row, quad_i32)
        r = r if patched is None else patched
      out[idx] = mgpu_utils.bitcast(r, f16x2)
    return mgpu.FragmentedArray(_registers=out, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

  return fn(words, *refs)


MMA_ASM = ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, "
            "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")


def regs_at(arr, mt, k, half):
  """The register of tile (mt, k), row half ``half`` of a WGMMA-layout FragmentedArray."""
  idx = [0] * arr.registers.ndim
  idx[0], idx[1], idx[4] = mt, k, half
  return arr.registers[tuple(idx)]


def mma16816(a, b, c):
  """One warp's ``d [16, 8] = a [16, 16] . b [16, 8] + c`` (fp16 in, f32 accumulate):
  a: four i32 (a0..a3 of the PTX fragment), b: two i32, c: two vector<2xf32> (rows g, g + 8)
  -> two vector<2xf32>."""
  f32 = ir.F32Type.get()
  cs = [vector.extract(x, dynamic_position=[], static_position=[e]) for x in c for e in (0, 1)]
  res = llvm.inline_asm(llvm.StructType.get_literal([f32] * 4), list(a) + list(b) + cs, MMA_ASM,
                        "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3")
  ds = [llvm.extractvalue(f32, res, [e]) for e in range(4)]
  return vec2(f32, ds[:2]), vec2(f32, ds[2:])


def movmatrix_t(x_i32):
  """The warp's 8x8 16-bit matrix (thread 4 g + t holds row g, columns 2 t, 2 t + 1) transposed."""
  i32 = ir.IntegerType.get_signless(32)
  return llvm.inline_asm(i32, [x_i32], "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r")


def frag(regs, layout=None):
  return mgpu.FragmentedArray(_registers=regs, _layout=layout or mgpu.WGMMA_LAYOUT, _is_signed=None)


def warp_scores(k16, q_ref, *, npad):
  """scores^T [64, npad] f32 (WGMMA layout) = k [64, D_pad] (fp16, WGMMA layout) . q^T, each
  warp its own 16 rows with mma.sync; ``q_ref [npad, D_pad]`` fp16 (128-byte swizzled, as
  ``stage_query`` writes it) gives the B fragments: thread 4 g + t loads q[8 n + g,
  16 kk + 2 t (+ 8)]. Two accumulators per column tile (even and odd kk) halve the chain."""
  wl = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=(wl, plgpu.RefType(transforms(k16.shape[1], 2))),
                     return_type=plgpu.ShapeDtypeStruct((SLOT, npad), jnp.float32, wl))
  def fn(ctx, ka, qref):
    del ctx
    f32, f16 = ir.F32Type.get(), ir.F16Type.get()
    f16x2 = ir.VectorType.get((2,), f16)
    tid = mgpu_utils.thread_idx()
    g = arith.andi(arith.shrui(tid, const_i32(2)), const_i32(7))
    t = arith.andi(tid, const_i32(3))
    dp = ka.shape[1]
    zero = arith.constant(f32, 0.0)
    out = np.empty(ka.registers.shape[:1] + (npad // 8,) + ka.registers.shape[2:], object)
    for ni in range(npad // 8):
      row = arith.addi(g, const_i32(8 * ni))
      accs = [[vec2(f32, [zero, zero])] * 2 for _ in range(2)]
      for kk in range(dp // 16):
        a = [as_i32(regs_at(ka, 0, 2 * kk + hk, h)) for hk in (0, 1) for h in (0, 1)]
        b = []
        for hk in (0, 1):
          col = arith.addi(const_i32(16 * kk + 8 * hk), arith.muli(t, const_i32(2)))
          b.append(as_i32(vector.load(f16x2, qref, [as_index(ni), as_index(16 * kk // 64), to_index(g),
                                                    to_index(swizzled_col(row, col))])))
        accs[kk % 2] = list(mma16816(a, b, accs[kk % 2]))
      for h in (0, 1):
        idx = [0] * out.ndim
        idx[1], idx[4] = ni, h
        out[tuple(idx)] = arith.addf(accs[0][h], accs[1][h])
    return frag(out)
  return fn(k16, q_ref)


def warp_colmax(x):
  """x [64, N] f32 (WGMMA layout) -> [64, N]: each warp's column maxima over its own 16 rows,
  in every row of the warp (three butterfly shuffles, no shared memory)."""
  wl = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=(wl,), return_type=plgpu.ShapeDtypeStruct(x.shape, jnp.float32, wl))
  def fn(ctx, xa):
    del ctx
    out = xa.registers.copy()
    for ni in range(xa.shape[1] // 8):
      m = arith.maximumf(regs_at(xa, 0, ni, 0), regs_at(xa, 0, ni, 1))
      for dist in (4, 8, 16):
        m = arith.maximumf(m, mgpu_utils.shfl_bfly(m, dist))
      for idx in np.ndindex(out.shape):
        if idx[1] == ni:
          out[idx] = m
    return frag(out)
  return fn(x)


def warp_scale(acc, f):
  """acc [M, N] (WGMMA layout; each warp's own rows) times f [64, N] (per-warp columns, as
  ``warp_colmax`` gives them): every register of a warp by its warp's factors."""
  wl = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=(wl, wl), return_type=plgpu.ShapeDtypeStruct(acc.shape, jnp.float32, wl))
  def fn(ctx, aa, fa):
    del ctx
    out = aa.registers.copy()
    for idx in np.ndindex(out.shape):
      out[idx] = arith.mulf(out[idx], regs_at(fa, 0, idx[1], 0))
    return frag(out)
  return fn(acc, f)


def transpose_words(words):
  """uint16 words [64, D_pad] (WGMMA layout) with every 8x8 register block transposed within
  its warp: register (k, half) then holds column ``8 k + g`` and rows ``16 w + 8 half + 2 t
  (+ 1)``, the A fragments of ``v^T`` over the warp's own 16 tokens."""
  wl = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=(wl,), return_type=plgpu.ShapeDtypeStruct(words.shape, words.dtype, wl))
  def fn(ctx, w):
    del ctx
    out = w.registers.copy()
    for idx in np.ndindex(out.shape):
      out[idx] = mgpu_utils.bitcast(movmatrix_t(as_i32(out[idx])), w.registers[idx].type)
    return mgpu.FragmentedArray(_registers=out, _layout=mgpu.WGMMA_LAYOUT, _is_signed=False)
  return fn(words)


def warp_pv(acc, v16t, p):
  """``acc [4 D_pad, N] += v^T . p^T`` per warp over its own 16 tokens (mma.sync): ``v16t``
  ``[64, D_pad]`` fp16, ``transpose_words``' arrangement (register (k, half): channel 8 k + g,
  tokens 8 half + 2 t (+ 1) of the warp); ``p [64, N]`` f32 (WGMMA layout), made the B fragment
  by an fp16 conversion and one transpose per 8 tokens; ``acc`` row ``64 mi + 16 w + 8 h + g``
  is warp w's channel ``16 mi + 8 h + g``."""
  wl = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=(wl, wl, wl), return_type=plgpu.ShapeDtypeStruct(acc.shape, jnp.float32, wl))
  def fn(ctx, aa, va, pa):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    out = aa.registers.copy()
    for ni in range(pa.shape[1] // 8):
      b = []
      for h in (0, 1):
        x = regs_at(pa, 0, ni, h)
        lo, hi = [vector.extract(x, dynamic_position=[], static_position=[e]) for e in (0, 1)]
        packed = llvm.inline_asm(i32, [lo, hi], "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f")
        b.append(movmatrix_t(packed))
      for mi in range(aa.shape[0] // 64):
        a = [as_i32(regs_at(va, 0, 2 * mi + hk, h)) for h in (0, 1) for hk in (0, 1)]
        c = [regs_at(aa, mi, ni, h) for h in (0, 1)]
        d = mma16816(a, b, c)
        for h in (0, 1):
          idx = [0] * out.ndim
          idx[0], idx[1], idx[4] = mi, ni, h
          out[tuple(idx)] = d[h]
    return frag(out)
  return fn(acc, v16t, p)


def sum_warps(red_ref, o_ref):
  """``red [4 D_pad, N]`` f32 (``warp_pv``'s rows: warp w's channel 16 mi + r at row
  64 mi + 16 w + r) summed over the four warps into ``o [D_pad, N]`` (shared memory)."""
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
  def fn(ctx, red, o):
    del ctx
    dp, n = ir.MemRefType(o.type).shape
    tid = arith.andi(mgpu_utils.thread_idx(), const_i32(127))
    for e in range(-(-dp * n // 128)):
      flat = arith.minui(arith.addi(tid, const_i32(128 * e)), const_i32(dp * n - 1))
      ch, col = arith.divui(flat, const_i32(n)), arith.remui(flat, const_i32(n))
      base = arith.addi(arith.muli(arith.shrui(ch, const_i32(4)), const_i32(64)), arith.andi(ch, const_i32(15)))
      total = None
      for w in range(4):
        x = memref.load(red, [to_index(arith.addi(base, const_i32(16 * w))), to_index(col)])
        total = x if total is None else arith.addf(total, x)
      memref.store(total, o, [to_index(ch), to_index(col)])
  fn(red_ref, o_ref)
