"""Quantized-KV decode attention for Hopper GPUs, written with Pallas' Mosaic GPU backend.

The same function as ``decode_attention.decode_attention`` (one query token per
sequence against a ``QuantizedKV``), laid out so that the tensor cores see no
padding on the token axis and the dequantized tiles never leave registers:

* One warpgroup (128 threads) per program ``(b, h, split)``. TMA brings one ``[64, D_pad]``
  tile of uint16 code words per step for keys and for values (``cpw`` slots of 64
  consecutive tokens each: 512 tokens at 2 bits), with the tile's scales,
  zero-points and outlier values, one tile in flight: 82 KB of shared memory, so two
  programs share an SM and one computes while the other waits (two tiles in flight:
  133 KB, one program per SM, 0.294 against 0.238 ms on an H200 at B=8, 32k). With
  ``split_fetch`` (default) the tiles are fetched by hand in two halves: the next tile's
  keys as soon as the score MMAs have read this tile's, its values after the output
  MMAs, so a program waits less for its own tiles (on-device profile, B=8, 32k: time
  outside the compute regions 22.5 -> 19.3 % of a program); with ``early_fetch``
  (default) each half as soon as its code words are in registers, before its MMAs
  (3.9 %); the first tile is requested before the program waits for its query. Without
  it, ``plgpu.emit_pipeline`` (``stages`` deep) fetches whole tiles.
* The query operand (scaled, channels in the cache's split order, padded) is built by the
  kernel from the raw queries (``_stage_query``), and the quantized token count from the
  lengths: no XLA kernels run before it (three fewer launches, ~4 us at B=8, 32k).
* Once per tile the fp8 metadata is turned into fp16 ``(s * 2**bits,
  z - s * 2**bits)`` in shared memory; the dequantization then loads, per
  thread, only the pair that scales its own rows and columns (one 32-bit load
  per two columns) and spends three instructions per two values (inline PTX on
  the registers of the MMA operand, see ``_dequant``). Interleaving
  the s2/z2 of two register tiles into one 128-bit load (``interleave_meta``) was
  slower each time it was timed (H200, B=8, 32k: 0.185 against 0.172 ms; with
  ``loop_descriptors`` 0.127 against 0.115; under ``warp_mma`` 0.102 against 0.096) and
  was removed (docs/benchmarks.md).
  ``in_place_codes=True`` (default) reads each slot where an in-place rotation of the
  words left it (``_read_plan``), two instructions per pair for most slots, with the
  slot's position folded into the staged scale (H200, B=8, 32k: 0.172 against 0.180 ms).
  ``loop_descriptors=True`` (default) keeps LLVM from hoisting the MMAs' shared-memory
  descriptors out of the tile loop, where ptxas holds them in ~40 registers
  (``_descriptors_in_loop``; H200, B=8, 32k: 0.163 against 0.175 ms when it landed).
* Slots are processed in phases of ``phase_slots`` (default: the whole tile).
  Phase part 1: for each slot, keys are dequantized into the register layout
  of a ``wgmma`` A operand (``[64 tokens, D_pad]`` fp16) and multiplied by the
  query held in shared memory, ``scores^T [64, N] = k . q^T`` (the query heads
  of one kv-head, padded to N = 8, or 16 above 8 heads, are the MMA's N; H200,
  B=8, 32k, 4 heads: N = 8 0.201 ms, N = 16 0.238); the MMAs are issued back to
  back, one left in flight while the next slot dequantizes. Then one
  online-softmax update for the whole phase (a single cross-warp max; the
  running sum stays distributed over rows until the end). Part 2: ``p^T`` of
  every slot goes to shared memory as the B operand of
  ``out^T [D_pad, N] += v^T . p^T`` (for N = 8 stored tokens-minor as ``p [N, 64]``
  by 16-bit stores, see ``_store_transposed``), whose A operand ``v^T`` is again
  dequantized in registers (loaded transposed, then moved to the MMA layout).
* ``warp_mma=True`` (default where the options allow it: ``split_fetch``, outliers staged
  in the MMA) replaces the warpgroup MMAs by ``mma.sync`` per warp: the WGMMA register
  layout is four stacked m16n8 fragments, so each warp's dequantized key rows (16 tokens of
  every slot) are an A operand as they stand; each warp keeps its own softmax state (no cross-warp max, no ``p`` in shared memory: ``p`` is
  turned into a B operand in registers by ``movmatrix``), value words are transposed per 8x8
  block in registers, and the four warps' partial outputs are combined once at the end. No
  MMA descriptors and no warpgroup coupling inside a phase (H100, B=8, 32k, 2-bit + 2 %:
  0.096 against 0.114 ms with ``wgmma``; B=1, 128k: 0.061 against 0.069).
* ``explicit_barriers=True`` (``warp_mma`` only; off) compiles without
  Pallas' automatic barriers (a warpgroup barrier before every copy and around every
  shared-memory store, ~20 per tile): the kernel's own commits order every shared write
  and buffer reuse. ``merged_barriers=True`` (same state) stages a half's metadata after
  its code words are in registers, so one commit per half-tile does both: two per tile.
  Both together are correct on an H100 but mixed (B=8, 32k: 0.090 vs 0.092 ms; 8x4k: 0.032
  vs 0.026), so both stay off (docs/benchmarks.md, session 21).
* Outlier channels (at most four) take the MMA's padding columns
  (``outliers_in_mma=True``, the default; needs ``d_low + n_out <= D_pad``): their
  16-bit values (as fp16) replace the dequantized registers of those key columns and
  ``v^T`` rows, and the query's outlier channels sit in the same columns, so the
  tensor cores do that work (H200, B=8, 32k: 0.298 against 0.317 ms for rank-1
  updates on the CUDA cores, which ``outliers_in_mma=False`` keeps). Each tile's outlier
  values are converted to fp16 once (``staged_outliers``, ``_stage_outliers``), so a
  patched register costs one 32-bit shared load and one select or lop3 (was ~13
  instructions: a fifth of the loop; H200, B=8, 32k: 0.196 -> 0.178 ms).
* Sinks and the full-precision window (a few dozen tokens) are attended, and the splits'
  partials merged in log2 units, by one Triton kernel after this one
  (``decode_merge_gpu.merge_heads_minor``; ``merge_kernel=False``: plain ``jnp``).
* Three programs per CTA, one per warpgroup (384 threads make ptxas fit 168 registers per
  thread, the only way to get a third program onto an SM), were correct but slower (H200,
  B=8, 32k, phase 4: 0.240 against 0.199 ms; 300 bytes spilled) and were removed with
  ``interleave_meta`` (commit f9cbe99 still has both). Splitting a program's keys
  and values over two warpgroups (softmax in one, output MMAs in the other, 512 threads per
  CTA) was slower too: 0.126 ms at best against 0.116 (commit e4c4760 has it).

Supported (``supports(layout, num_q_heads)``): keys per channel and values per
token (KIVI's assignment), ``D_pad`` a multiple of 64, ``group_size`` >= 32
dividing the 64-token slot or a multiple of it, at most 4 outlier channels
and at most 16 query heads per kv-head. Anything else goes to the Triton kernel.
It runs on sm_90 only (no interpret mode: the dequantization works on the
registers of the MMA layout); ``experiments/check_decode_gpu.py`` checks it
against the reference on the GPU.
"""
from __future__ import annotations

import functools
import importlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref, vector

from pallas_kernels import kv_quant as kq
from pallas_kernels.decode_merge import LOG2E, NEG, merge_partials, scaled_queries
from pallas_kernels.decode_merge_gpu import merge_heads_minor

# the module (the package re-exports its ``wgmma`` function under the same name)
mgpu_wgmma = importlib.import_module("jax.experimental.mosaic.gpu.wgmma")

NQ = 16                    # most query heads per kv-head (the MMAs' N: 8 up to 8 heads, else 16)
SLOT = kq.PACK_STRIDE      # 64 tokens per code slot = M of the key MMA
MAX_OUTLIERS = 4
_NOP = lambda n: 2 if n <= 2 else 4   # outlier rows of the small buffers (copies of >= 128 bytes)
_TARGET_PROGRAMS = 256  # default splits: ~one wave (2 programs resident per SM, 132 SMs). H200,
                         # warp_mma (2026-12-06): B=8 32k 4 splits 0.093-0.095 ms, 8 0.096-0.097;
                         # B=1 128k 32 splits 0.053-0.054, 64 0.059; B=8 128k 4 / 8 0.334 / 0.336
STAGES = 1               # TMA pipeline depth (tiles in flight per program; see below)
PHASE_SLOTS = 8          # 64-token slots per softmax update, capped at cpw (H200, B=8, 32k, 2-bit:
                         # 8 -> 0.311 ms, 4 -> 0.320, 2 -> 0.338, 1 -> 0.419)
STAGED_OUTLIERS = True   # outliers_in_mma: each tile's outlier values staged once as fp16, so a patched
                         # MMA register costs a shared load and a select (was ~13 instructions)
IN_PLACE_CODES = True    # read slots where the rotation left them (_read_plan): fewer rotations
                         # (H200, B=8 32k: 0.172 vs 0.180 ms; B=1 128k 0.130 vs 0.133; SASS 3,249 vs 3,501)
MERGED_BARRIERS = False  # warp_mma, early fetches, one phase: one warpgroup barrier per half-tile
                         # (codes loaded, metadata staged, next half fetched) instead of two
EXPLICIT_BARRIERS = False  # warp_mma: Pallas inserts no barriers of its own around shared stores
                         # and copies (unsafe_no_auto_barriers; ~20 per tile); the kernel's commits
                         # order every shared write and reuse (see _program)
LOOP_DESCRIPTORS = True  # MMA descriptors formed in the loop, not held in registers across it
                         # (_descriptors_in_loop; H200, B=8 32k: 0.163 / 0.158 vs 0.175 / 0.172 ms,
                         # 255 registers + 80 B spilled -> 235, none)
_N_COMMON = 10           # scratch buffers every program has (before its _Own ones)
SPLIT_FETCH = True       # tiles fetched by hand in key and value halves, each as soon as its
                         # buffers are free (H200: B=8 32k 0.199 -> 0.194 ms, B=1 128k 0.144 -> 0.140)
WARP_MMA = True          # each warp its own 16 tokens per slot with mma.sync, own softmax state,
                         # where the options allow it (_warp_mma_applies); H100, B=8 32k, 2-bit +
                         # 2 %: 0.096-0.097 vs 0.114-0.115 ms with wgmma; 1x128k 0.061 vs 0.069
EARLY_FETCH = True       # split_fetch: a half's next tile is fetched as soon as its codes are in
                         # registers (its metadata and outliers already staged), not after its MMAs
                         # (H200, B=8 32k: 0.118-0.119 vs 0.119-0.120 ms; 1x128k 0.072 vs 0.073)


def supports(layout: kq.KVLayout, num_q_heads_per_kv: int) -> bool:
  """Whether this kernel handles caches of this layout (else use the Triton kernel)."""
  cfg = layout.config
  g = cfg.group_size
  tile = SLOT * layout.cpw
  return (cfg.key_axis == "channel" and cfg.value_axis == "token"
          and layout.d_pad % 64 == 0 and layout.cq > 0
          and g >= 32 and (SLOT % g == 0 or g % SLOT == 0) and tile % g == 0
          and layout.n_out <= MAX_OUTLIERS and num_q_heads_per_kv <= NQ)


def is_hopper() -> bool:
  """Whether jax's default device is a Hopper GPU (compute capability 9.x)."""
  dev = jax.devices()[0]
  return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def _p_tokens_minor(npad):
  """Whether p^T ``[64, npad]`` fp16 has rows too short (< 32 bytes) for a wgmma swizzle, so
  ``p`` is stored tokens-minor as ``[npad, 64]`` (``_store_transposed``)."""
  return npad * 2 < 32


def _chunk(tile_tokens):
  """Tokens per TMA box of the token-minor arrays: <= 256 and dividing the tile."""
  return next(c for c in (256, 128, 64) if tile_tokens % c == 0)


def _swizzled(minor_bytes):
  sw = next(s for s in (128, 64, 32) if minor_bytes % s == 0)
  return sw


def _transforms(minor_elems, itemsize):
  sw = _swizzled(minor_elems * itemsize)
  return (plgpu.TilingTransform((8, sw // itemsize)), plgpu.SwizzleTransform(sw))


COL = plgpu.Layout.WGMMA.reduce(0)    # a vector along the columns of a WGMMA-layout array
ROW = plgpu.Layout.WGMMA.reduce(1)    # ... along its rows


def _col(x):
  return plgpu.layout_cast(x, COL)


def _ld(ref, idx, layout):
  return plgpu.load(ref, idx, layout=layout).astype(jnp.float32)



def _meta_pair(s, z, bits):
  """Metadata (fp8/bf16/fp16) -> fp16 (s * 2**bits, z - s * 2**bits): x = v * s2 + z2
  for v = 1 + code * 2**-bits. Both in fp16: 2**bits is exact, the subtraction is
  rounded once (as the Triton kernel does it in float32 and then rounds)."""
  s16, z16 = s.astype(jnp.float16), z.astype(jnp.float16)
  s2 = s16 * jnp.float16(1 << bits)
  return s2, z16 - s2


def _dequant_asm(bits, slot, timing_form=""):
  """Two fp16 from the uint16 words of two neighbouring channels (one 32-bit register):
  rotate slot ``slot``'s codes to the top mantissa bits of both halves, mask, OR in 1.0
  (lop3), then ``v * s2 + z2`` (fma.f16x2). Three instructions per pair.

  ``timing_form`` (ablations ``noshift`` / ``fp2``: wrong values, timing only) leaves the
  rotation out, or spends an fma with one constant pair in its place. Beware: every slot
  then has the same mask, so ptxas merges the slots' lop3 and fma (SASS: LOP3 756 -> 308);
  their times (H200, B=8, 32k: 0.180 -> 0.165 / 0.166 ms) are not the rotation's cost."""
  top = ((1 << bits) - 1) << (10 - bits)
  rot = (slot * bits - (10 - bits)) % 32
  if timing_form:
    extra = ("mov.b32 k, 0x64006400; mov.b32 n, 0xe400e400; fma.rn.f16x2 t, t, k, n; "
             if timing_form == "fp2" else "")
    return ("{ .reg .b32 t, k, n; "
            f"lop3.b32 t, $1, {top | (top << 16):#010x}, 0x3c003c00, 0xea; " + extra +
            "fma.rn.f16x2 $0, t, $2, $3; }")
  return ("{ .reg .b32 t; "
          f"shf.r.wrap.b32 t, $1, $1, {rot}; "
          f"lop3.b32 t, t, {top | (top << 16):#010x}, 0x3c003c00, 0xea; "
          "fma.rn.f16x2 $0, t, $2, $3; }")


def _dequant_asm_at(bits, pos):
  """As ``_dequant_asm`` for codes already at bits ``[pos, pos + bits)`` of both halves
  (``in_place_codes``): lop3 and fma, no rotation. v = 1 + code * 2**(pos - 10), so the
  staged scale must be ``s * 2**(10 - pos)`` (``_read_plan``)."""
  mask = ((1 << bits) - 1) << pos
  return ("{ .reg .b32 t; "
          f"lop3.b32 t, $1, {mask * 0x10001:#010x}, 0x3c003c00, 0xea; "
          "fma.rn.f16x2 $0, t, $2, $3; }")


def _read_plan(bits, cpw, phase):
  """``in_place_codes``: for each slot, (rotation to apply to the phase's code words before
  reading it, 0 for none; the bit position its codes then sit at). Slot j's codes start
  at bit ``bits * j`` of each 16-bit half; a rotation right by R of the 32-bit register
  moves them to ``bits * j - R`` in both halves. They are read at positions
  ``[lo, 10 - bits]``, ``lo = min(4, 10 - bits)``: inside the mantissa, with a multiplier
  ``2**(10 - pos) <= max(64, 2**bits)``, so that rounding ``z - s * 2**(10 - pos)`` to fp16
  costs at most 1/32 of a quantization step (plus ``|z| / 2048``; the rotate-to-the-top
  form: 2**bits / 2048 of a step). Each rotation places the next slot at
  ``lo`` and serves the slots after it while they fit: at 2 bits three rotations per
  eight slots instead of seven. The words are reloaded (unrotated) every phase."""
  lo, hi = min(4, 10 - bits), 10 - bits
  plan = {}
  for j0 in range(0, cpw, phase):
    rot = 0
    for j in range(j0, min(j0 + phase, cpw)):
      pos = (bits * j - rot) % 32
      delta = 0
      if not lo <= pos <= hi:
        new = (bits * j - lo) % 32
        delta, rot, pos = (new - rot) % 32, new, lo
      plan[j] = (delta, pos)
  return plan


def _rotate_words(words, r):
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


def _dequant(words, meta_ref, *, bits, slot, meta_index, patch_ref=None, patch=None,
             timing_form="", pos=None, meta_key=None):
  """uint16 code words [M, N] (WGMMA layout) -> fp16 [M, N] (WGMMA layout), in registers.

  meta_ref: shared memory ``f16[2, ...]`` holding ``s2 = s * 2**bits`` (``[0]``) and
  ``z2 = z - s2`` (``[1]``), staged once per tile (``pos``, for ``in_place_codes``: the
  codes already sit at bits ``[pos, pos + bits)`` and s2 = s * 2**(10 - pos); no
  rotation). ``meta_index(mt, k, warp, quad)``
  gives the indices (into ``meta_ref[0]``) of the f16 pair that scales the two
  columns a thread holds in register tile ``(mt, k)``: in the WGMMA layout, thread
  ``32 * warp + 4 * r + quad`` holds rows ``64 mt + 16 warp + r (+ 8)`` and columns
  ``8 k + 2 quad (+ 1)``. Each thread loads only the metadata of its own rows (one
  32-bit shared load per pair of columns), so a group boundary between warps costs
  nothing.

  ``meta_key(mt, k, half)`` (optional): registers with equal keys share one metadata pair,
  ``meta_index(mt, k, warp, quad, half)`` then gets the row half too (``warp_mma``'s
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
    warp_i32 = arith.andi(arith.shrui(tid, _i32(5)), _i32(3))
    warp = _index(warp_i32)
    quad_i32 = arith.andi(tid, _i32(3))
    quad = _index(quad_i32)
    # timing-only forms (wrong values): "raw" feeds the code words to the MMA as they are (no
    # dequantization, no metadata loads), "nometa" dequantizes with constant s2 = 1, z2 = 0
    raw, nometa = timing_form == "raw", timing_form == "nometa"
    if raw or nometa:
      asm = _dequant_asm_at(bits, pos if pos is not None else 10 - bits)
    else:
      asm = _dequant_asm(bits, slot, timing_form) if pos is None else _dequant_asm_at(bits, pos)
    regs = w.registers
    out = regs.copy()
    meta = {}
    if patch is not None:
      row = arith.addi(arith.muli(warp_i32, _i32(16)),
                       arith.shrui(arith.andi(tid, _i32(31)), _i32(2)))
    for idx in np.ndindex(regs.shape):
      mt, k = idx[0], idx[1]
      key = (mt, k) if meta_key is None else meta_key(mt, k, idx[4])
      if (raw or nometa) and key not in meta:
        meta[key] = [_i32(0x3C003C00), _i32(0)]
      elif key not in meta:
        ii = (meta_index(mt, k, warp, quad) if meta_key is None
              else meta_index(mt, k, warp, quad, idx[4]))
        meta[key] = [mgpu_utils.bitcast(vector.load(f16x2, mref, [arith.constant(index, a)] + ii), i32)
                     for a in (0, 1)]
      w32 = mgpu_utils.bitcast(regs[idx], i32)
      s2, z2 = meta[key]
      r = w32 if raw else llvm.inline_asm(i32, [w32, s2, z2], asm, "=r,r,r,r")
      if patch is not None:
        patched = patch(idx[0], idx[1], idx[4], r, pref[0], row, quad_i32)
        r = r if patched is None else patched
      out[idx] = mgpu_utils.bitcast(r, f16x2)
    return mgpu.FragmentedArray(_registers=out, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

  return fn(words, *refs)


def _store_transposed(x, ref):
  """Stores x [64, N] (fp16, WGMMA layout) into ``ref [N, 64]`` (tiled (8, 64), 128-byte
  swizzle) as x^T, one 16-bit store per value: Pallas refuses a transposed store into a
  swizzled dimension. Element (n, t) sits in row n, 16-byte chunk (t // 8) ^ (n % 8)."""
  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(_transforms(SLOT, 2))))
  def fn(ctx, xa, mref):
    del ctx
    i16, f16 = ir.IntegerType.get_signless(16), ir.F16Type.get()
    tid = mgpu_utils.thread_idx()
    warp = arith.andi(arith.shrui(tid, _i32(5)), _i32(3))
    r = arith.andi(arith.shrui(tid, _i32(2)), _i32(7))
    quad = arith.andi(tid, _i32(3))
    zero = _ix(0)
    for idx in np.ndindex(xa.registers.shape):   # [64, 8]: one register per row half
      half = idx[4]
      pair = mgpu_utils.bitcast(xa.registers[idx], ir.IntegerType.get_signless(32))
      chunk = arith.addi(arith.muli(warp, _i32(2)), _i32(half))     # (16 w + r + 8 half) // 8
      for e in (0, 1):
        n = arith.addi(arith.muli(quad, _i32(2)), _i32(e))
        col = arith.ori(arith.shli(arith.xori(chunk, n), _i32(3)), r)
        bits16 = arith.trunci(i16, pair if e == 0 else arith.shrui(pair, _i32(16)))
        memref.store(arith.bitcast(f16, bits16), mref, [zero, zero, _index(n), _index(col)])
  fn(x, ref)


# --- warp_mma: each warp multiplies its own 16 tokens with mma.sync (no warpgroup coupling) ---
# The WGMMA register layout of a [64, N] array is four stacked m16n8 fragments, one per warp:
# thread 32 w + 4 g + t holds rows 16 w + g (+ 8: "half") and columns 8 k + 2 t (+ 1) of
# register tile k. A warp's rows of the key tile are then an mma.sync A operand as they stand.

_MMA_ASM = ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, "
            "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")


def _regs_at(arr, mt, k, half):
  """The register of tile (mt, k), row half ``half`` of a WGMMA-layout FragmentedArray."""
  idx = [0] * arr.registers.ndim
  idx[0], idx[1], idx[4] = mt, k, half
  return arr.registers[tuple(idx)]


def _as_i32(x):
  return mgpu_utils.bitcast(x, ir.IntegerType.get_signless(32))


def _vec2(ty, elems):
  """vector<2 x ty> from two scalars (insertions into undef, as Mosaic builds its vectors)."""
  v = llvm.mlir_undef(ir.VectorType.get((2,), ty))
  for e, x in enumerate(elems):
    v = vector.insert(x, v, dynamic_position=[], static_position=[e])
  return v


def _mma16816(a, b, c):
  """One warp's ``d [16, 8] = a [16, 16] . b [16, 8] + c`` (fp16 in, f32 accumulate):
  a: four i32 (a0..a3 of the PTX fragment), b: two i32, c: two vector<2xf32> (rows g, g + 8)
  -> two vector<2xf32>."""
  f32 = ir.F32Type.get()
  cs = [vector.extract(x, dynamic_position=[], static_position=[e]) for x in c for e in (0, 1)]
  res = llvm.inline_asm(llvm.StructType.get_literal([f32] * 4), list(a) + list(b) + cs, _MMA_ASM,
                        "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3")
  ds = [llvm.extractvalue(f32, res, [e]) for e in range(4)]
  return _vec2(f32, ds[:2]), _vec2(f32, ds[2:])


def _movmatrix_t(x_i32):
  """The warp's 8x8 16-bit matrix (thread 4 g + t holds row g, columns 2 t, 2 t + 1) transposed."""
  i32 = ir.IntegerType.get_signless(32)
  return llvm.inline_asm(i32, [x_i32], "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r")


def _frag(regs, layout=None):
  return mgpu.FragmentedArray(_registers=regs, _layout=layout or mgpu.WGMMA_LAYOUT, _is_signed=None)


def _warp_scores(k16, q_ref, *, npad):
  """scores^T [64, npad] f32 (WGMMA layout) = k [64, D_pad] (fp16, WGMMA layout) . q^T, each
  warp its own 16 rows with mma.sync; ``q_ref [npad, D_pad]`` fp16 (128-byte swizzled, as
  ``_stage_query`` writes it) gives the B fragments: thread 4 g + t loads q[8 n + g,
  16 kk + 2 t (+ 8)]. Two accumulators per column tile (even and odd kk) halve the chain."""
  wl = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=(wl, plgpu.RefType(_transforms(k16.shape[1], 2))),
                     return_type=plgpu.ShapeDtypeStruct((SLOT, npad), jnp.float32, wl))
  def fn(ctx, ka, qref):
    del ctx
    f32, f16 = ir.F32Type.get(), ir.F16Type.get()
    f16x2 = ir.VectorType.get((2,), f16)
    tid = mgpu_utils.thread_idx()
    g = arith.andi(arith.shrui(tid, _i32(2)), _i32(7))
    t = arith.andi(tid, _i32(3))
    dp = ka.shape[1]
    zero = arith.constant(f32, 0.0)
    out = np.empty(ka.registers.shape[:1] + (npad // 8,) + ka.registers.shape[2:], object)
    for ni in range(npad // 8):
      row = arith.addi(g, _i32(8 * ni))
      accs = [[_vec2(f32, [zero, zero])] * 2 for _ in range(2)]
      for kk in range(dp // 16):
        a = [_as_i32(_regs_at(ka, 0, 2 * kk + hk, h)) for hk in (0, 1) for h in (0, 1)]
        b = []
        for hk in (0, 1):
          col = arith.addi(_i32(16 * kk + 8 * hk), arith.muli(t, _i32(2)))
          b.append(_as_i32(vector.load(f16x2, qref, [_ix(ni), _ix(16 * kk // 64), _index(g),
                                                    _index(_swizzled_col(row, col))])))
        accs[kk % 2] = list(_mma16816(a, b, accs[kk % 2]))
      for h in (0, 1):
        idx = [0] * out.ndim
        idx[1], idx[4] = ni, h
        out[tuple(idx)] = arith.addf(accs[0][h], accs[1][h])
    return _frag(out)
  return fn(k16, q_ref)


def _warp_colmax(x):
  """x [64, N] f32 (WGMMA layout) -> [64, N]: each warp's column maxima over its own 16 rows,
  in every row of the warp (three butterfly shuffles, no shared memory)."""
  wl = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=(wl,), return_type=plgpu.ShapeDtypeStruct(x.shape, jnp.float32, wl))
  def fn(ctx, xa):
    del ctx
    out = xa.registers.copy()
    for ni in range(xa.shape[1] // 8):
      m = arith.maximumf(_regs_at(xa, 0, ni, 0), _regs_at(xa, 0, ni, 1))
      for dist in (4, 8, 16):
        m = arith.maximumf(m, mgpu_utils.shfl_bfly(m, dist))
      for idx in np.ndindex(out.shape):
        if idx[1] == ni:
          out[idx] = m
    return _frag(out)
  return fn(x)


def _warp_scale(acc, f):
  """acc [M, N] (WGMMA layout; each warp's own rows) times f [64, N] (per-warp columns, as
  ``_warp_colmax`` gives them): every register of a warp by its warp's factors."""
  wl = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=(wl, wl), return_type=plgpu.ShapeDtypeStruct(acc.shape, jnp.float32, wl))
  def fn(ctx, aa, fa):
    del ctx
    out = aa.registers.copy()
    for idx in np.ndindex(out.shape):
      out[idx] = arith.mulf(out[idx], _regs_at(fa, 0, idx[1], 0))
    return _frag(out)
  return fn(acc, f)


def _transpose_words(words):
  """uint16 words [64, D_pad] (WGMMA layout) with every 8x8 register block transposed within
  its warp: register (k, half) then holds column ``8 k + g`` and rows ``16 w + 8 half + 2 t
  (+ 1)``, the A fragments of ``v^T`` over the warp's own 16 tokens."""
  wl = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=(wl,), return_type=plgpu.ShapeDtypeStruct(words.shape, words.dtype, wl))
  def fn(ctx, w):
    del ctx
    out = w.registers.copy()
    for idx in np.ndindex(out.shape):
      out[idx] = mgpu_utils.bitcast(_movmatrix_t(_as_i32(out[idx])), w.registers[idx].type)
    return mgpu.FragmentedArray(_registers=out, _layout=mgpu.WGMMA_LAYOUT, _is_signed=False)
  return fn(words)


def _warp_pv(acc, v16t, p):
  """``acc [4 D_pad, N] += v^T . p^T`` per warp over its own 16 tokens (mma.sync): ``v16t``
  ``[64, D_pad]`` fp16, ``_transpose_words``' arrangement (register (k, half): channel 8 k + g,
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
        x = _regs_at(pa, 0, ni, h)
        lo, hi = [vector.extract(x, dynamic_position=[], static_position=[e]) for e in (0, 1)]
        packed = llvm.inline_asm(i32, [lo, hi], "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f")
        b.append(_movmatrix_t(packed))
      for mi in range(aa.shape[0] // 64):
        a = [_as_i32(_regs_at(va, 0, 2 * mi + hk, h)) for h in (0, 1) for hk in (0, 1)]
        c = [_regs_at(aa, mi, ni, h) for h in (0, 1)]
        d = _mma16816(a, b, c)
        for h in (0, 1):
          idx = [0] * out.ndim
          idx[0], idx[1], idx[4] = mi, ni, h
          out[tuple(idx)] = d[h]
    return _frag(out)
  return fn(acc, v16t, p)


def _sum_warps(red_ref, o_ref):
  """``red [4 D_pad, N]`` f32 (``_warp_pv``'s rows: warp w's channel 16 mi + r at row
  64 mi + 16 w + r) summed over the four warps into ``o [D_pad, N]`` (shared memory)."""
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
  def fn(ctx, red, o):
    del ctx
    dp, n = ir.MemRefType(o.type).shape
    tid = arith.andi(mgpu_utils.thread_idx(), _i32(127))
    for e in range(-(-dp * n // 128)):
      flat = arith.minui(arith.addi(tid, _i32(128 * e)), _i32(dp * n - 1))
      ch, col = arith.divui(flat, _i32(n)), arith.remui(flat, _i32(n))
      base = arith.addi(arith.muli(arith.shrui(ch, _i32(4)), _i32(64)), arith.andi(ch, _i32(15)))
      total = None
      for w in range(4):
        x = memref.load(red, [_index(arith.addi(base, _i32(16 * w))), _index(col)])
        total = x if total is None else arith.addf(total, x)
      memref.store(total, o, [_index(ch), _index(col)])
  fn(red_ref, o_ref)


def _slot_exponent(x, *, unit, exps):
  """MLIR: ``exps[(x // unit) % len(exps)]`` for an i32 flat element index ``x`` (the
  exponents, < 16, packed 4 bits per slot into one i32 constant; at most 8 slots)."""
  assert len(exps) <= 8 and all(0 <= e < 16 for e in exps)
  table = sum(e << (4 * j) for j, e in enumerate(exps))
  table -= (1 << 32) if table >= 1 << 31 else 0
  slot = arith.remui(arith.divui(x, _i32(unit)), _i32(len(exps)))
  return arith.andi(arith.shrui(_i32(table), arith.muli(slot, _i32(4))), _i32(15))


def _stage_outliers(src_ref, dst_ref, *, tokens_major, base=0):
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
    tid = arith.andi(mgpu_utils.thread_idx(), _i32(127))
    for i in range(-(-t_all // 128)):
      t = arith.minui(arith.addi(tid, _i32(128 * i)), _i32(t_all - 1))   # repeats write alike
      ti = [_index(arith.divui(t, _i32(c))), _index(arith.remui(t, _i32(c)))]
      for o in range(n):
        x = arith.truncf(f16, arith.extf(f32, memref.load(src, [_ix(o)] + ti)))
        memref.store(x, dst, [_index(t), _ix(base + o)] if tokens_major else [_ix(o)] + ti)
  fn(src_ref, dst_ref)


def _stage_query(raw_ref, idx_ref, dst_ref, *, dp, d_low, scale):
  """The score MMA's query operand, built in the kernel from the raw queries (no XLA
  kernels before it): ``raw [g, D]`` (smem, any float dtype) and the key outlier channels
  ``idx [n_out]`` (global memory, any order) -> ``dst [npad, D_pad]`` fp16 (swizzled as
  the MMA reads it), row ``n < g``, column ``c``: ``scale`` times query channel
  ``split[c]``: the c-th non-outlier channel (ascending) for ``c < d_low``, outlier
  ``c - d_low`` up to ``d_low + n_out``; zeros elsewhere (as ``quantized_partials`` builds
  it in XLA). Each thread writes every 128th element."""
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(_transforms(dp, 2))))
  def fn(ctx, raw, idx, dst):
    del ctx
    f32, f16 = ir.F32Type.get(), ir.F16Type.get()
    g, d = ir.MemRefType(raw.type).shape
    n_out = ir.MemRefType(idx.type).shape[0] if d_low < d else 0
    npad = ir.MemRefType(dst.type).shape[0] * 8
    tid = arith.andi(mgpu_utils.thread_idx(), _i32(127))
    ids = [memref.load(idx, [_ix(k)]) for k in range(n_out)]           # i32
    # t_k: non-outlier channels below outlier k; the j-th non-outlier is j + #{k: t_k <= j}
    ts = []
    for k in range(n_out):
      below = _i32(0)
      for m in range(n_out):
        lt = arith.cmpi(arith.CmpIPredicate.slt, ids[m], ids[k])
        below = arith.addi(below, arith.extui(ir.IntegerType.get_signless(32), lt))
      ts.append(arith.subi(ids[k], below))
    for e in range(npad * dp // 128):
      flat = arith.addi(tid, _i32(128 * e))
      n, c = arith.divui(flat, _i32(dp)), arith.remui(flat, _i32(dp))
      src = c
      for t in ts:
        le = arith.cmpi(arith.CmpIPredicate.sle, t, c)
        src = arith.addi(src, arith.extui(ir.IntegerType.get_signless(32), le))
      for k in range(n_out):
        src = arith.select(arith.cmpi(arith.CmpIPredicate.eq, c, _i32(d_low + k)), ids[k], src)
      valid = arith.andi(arith.cmpi(arith.CmpIPredicate.ult, n, _i32(g)),
                         arith.cmpi(arith.CmpIPredicate.ult, c, _i32(d_low + n_out)))
      x = memref.load(raw, [_index(arith.minui(n, _i32(g - 1))), _index(arith.minui(src, _i32(d - 1)))])
      x = arith.mulf(x if x.type == f32 else arith.extf(f32, x), arith.constant(f32, scale))
      x = arith.select(valid, arith.truncf(f16, x), arith.constant(f16, 0.0))
      memref.store(x, dst, [_index(arith.shrui(n, _i32(3))), _index(arith.shrui(c, _i32(6))),
                            _index(arith.andi(n, _i32(7))), _index(_swizzled_col(n, c))])
  fn(raw_ref, idx_ref, dst_ref)


def _swizzled_col(row, col):
  """Column inside a 128-byte-swizzled (8, 64) fp16 tile: the 16-byte chunk ``col // 8`` of
  row ``row`` sits at chunk ``(col // 8) ^ (row % 8)`` (i32 in, i32 out)."""
  chunk = arith.xori(arith.shrui(arith.andi(col, _i32(63)), _i32(3)), arith.andi(row, _i32(7)))
  return arith.ori(arith.shli(chunk, _i32(3)), arith.andi(col, _i32(7)))


_POW2_FORMAT = {jnp.dtype(jnp.float16): (16, 15, 10), jnp.dtype(jnp.bfloat16): (16, 127, 7),
                jnp.dtype(jnp.float8_e4m3fn): (8, 7, 3)}     # bits, exponent bias, mantissa bits


def _fill_slot_multipliers(dst_ref, *, unit, exps):
  """``in_place_codes``: ``dst`` (the metadata's dtype, so it loads in the metadata's
  register layout; any contiguous shape, n elements) element ``e`` = ``2**exps[j]``
  (exact in fp8 too) of its slot ``j = (e // unit) % cpw`` (``_read_plan``): a tile's
  staged scales are then one whole-array multiply (row-by-row or slot-by-slot slices cost
  a warpgroup barrier each: 88 per tile at 2 bits). Written once per program."""
  width, bias, mant = _POW2_FORMAT[jnp.dtype(dst_ref.dtype)]

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def fn(ctx, dst):
    del ctx
    ty = ir.MemRefType(dst.type)
    n, iw = int(np.prod(ty.shape)), ir.IntegerType.get_signless(width)
    tid = arith.andi(mgpu_utils.thread_idx(), _i32(127))
    ptr = mgpu_utils.memref_ptr(dst)
    for i in range(-(-n // 128)):
      e = arith.minui(arith.addi(tid, _i32(128 * i)), _i32(n - 1))    # repeats write alike
      exp = _slot_exponent(e, unit=unit, exps=exps)
      bits = arith.shli(arith.addi(exp, _i32(bias)), _i32(mant))       # 2**exp
      llvm.store(arith.trunci(iw, bits), mgpu_utils.getelementptr(ptr, [e], iw))
  fn(dst_ref)


_ARMED_CONTEXT = []     # the MLIR context of the kernel that asked for loop_descriptors (at most one)


def _descriptors_in_loop(on: bool):
  """Mosaic computes each wgmma's shared-memory descriptor once, before the tile loop
  (LLVM hoists it), so ptxas keeps the 40 64-bit descriptors of a tile's 128 MMAs in
  registers for the whole loop (the kernel runs at 255 with spills) and moves them to
  uniform registers before every MMA. With ``on``, each wgmma of this kernel passes its
  descriptor through a side-effecting ``mov``, which LLVM cannot hoist: only ~10 bases
  stay live and the descriptors are rebuilt next to their MMAs. Offline (the default
  kernel's PTX with this rewrite, ptxas 13.5): 255 -> 237 registers, 80 B -> 0 spilled,
  3,249 -> 2,997 loop instructions, static stalls -23 %. The math is unchanged.

  Called when Pallas lowers the start of this kernel's body (``_at_lowering``): wraps jax's
  ``wgmma_m64`` (looked up in its module at each call) once, and arms the wrapper for the
  MLIR context being lowered, which is this kernel's own: any wgmma lowered in it, also by
  a pass after the body, gets the mov; other kernels pass straight through. ``on=False``
  disarms (a kernel without the option)."""
  cur = getattr(mgpu_wgmma, "wgmma_m64", None)
  if on and cur is None:
    raise NotImplementedError("loop_descriptors needs jax.experimental.mosaic.gpu.wgmma.wgmma_m64 "
                              f"(jax 0.10-0.11); this jax ({jax.__version__}) has none")
  _ARMED_CONTEXT[:] = [ir.Context.current] if on else []
  if on and not hasattr(cur, "moejax_original"):
    def wgmma_m64(acc, a, b_descriptor, *args, **kwargs):
      if _descriptors_armed():
        b_descriptor = llvm.inline_asm(b_descriptor.type, [b_descriptor], "mov.b64 $0, $1;", "=l,l",
                                       has_side_effects=True)
      return cur(acc, a, b_descriptor, *args, **kwargs)
    wgmma_m64.moejax_original = cur
    mgpu_wgmma.wgmma_m64 = wgmma_m64


def _descriptors_armed() -> bool:
  """Whether the MLIR context being lowered is that of a kernel with loop_descriptors."""
  return bool(_ARMED_CONTEXT) and ir.Context.current is _ARMED_CONTEXT[0]


def _at_lowering(fn):
  """Runs ``fn()`` when Pallas lowers this point of the kernel body (not when tracing)."""
  @plgpu.inline_mgpu()
  def hook(ctx):
    del ctx
    fn()
  hook()


def _i32(x):
  return arith.constant(ir.IntegerType.get_signless(32), x)


def _f16_bits(x_f32):
  """f32 scalar -> its fp16 rounding's bits, as an i32 in the low half."""
  i16 = ir.IntegerType.get_signless(16)
  h = arith.truncf(ir.F16Type.get(), x_f32)
  return arith.extui(ir.IntegerType.get_signless(32), arith.bitcast(i16, h))


def _bf16_bits_to_f32(bits_i32):
  """bf16 bits in the low half of an i32 -> f32."""
  return arith.bitcast(ir.F32Type.get(), arith.shli(arith.andi(bits_i32, _i32(0xFFFF)), _i32(16)))


def _select_halves(pred_lo, lo, pred_hi, hi, old):
  """i32 of two 16-bit halves: the low half from lo where pred_lo, the high from hi where
  pred_hi, else old's."""
  old_lo = arith.andi(old, _i32(0xFFFF))
  old_hi = arith.shrui(old, _i32(16))
  new_lo = arith.select(pred_lo, lo, old_lo)
  new_hi = arith.select(pred_hi, hi, old_hi)
  return arith.ori(new_lo, arith.shli(new_hi, _i32(16)))


def _in_range(x_i32, lo, hi):
  """lo <= x < hi and clamp(x - lo, 0, hi - lo - 1) (i32 values)."""
  ge = arith.cmpi(arith.CmpIPredicate.sge, x_i32, _i32(lo))
  lt = arith.cmpi(arith.CmpIPredicate.slt, x_i32, _i32(hi))
  off = arith.minsi(arith.maxsi(arith.subi(x_i32, _i32(lo)), _i32(0)), _i32(hi - lo - 1))
  return arith.andi(ge, lt), off


def _index(x_i32):
  return arith.index_cast(ir.IndexType.get(), x_i32)


def _ix(x):
  """int or index Value -> index Value."""
  return arith.constant(ir.IndexType.get(), x) if isinstance(x, int) else x


def _affine(base, coef, var, div=1, cap=None):
  """(base + coef * var) // div, optionally min(., cap): index arithmetic in MLIR."""
  v = arith.addi(_ix(base), arith.muli(_ix(coef), var))
  if div != 1:
    v = arith.divui(v, _ix(div))
  return v if cap is None else arith.minui(v, _ix(cap))


class _Own(NamedTuple):
  """A program's own shared buffers when its tiles are fetched by hand (``split_fetch``;
  allocated in ``quantized_partials``, in this order)."""
  tiles: tuple              # 8 tile buffers, as the block specs: k codes, scale, zero, outliers; v ...
  kbar: Any                 # key-half and value-half tile barriers
  vbar: Any
  o: Any                    # output staging: o^T [D_pad, N], o_out [nop, N], (m, l) [2, N]
  oo: Any
  ml: Any

  @classmethod
  def of(cls, refs):
    return cls(tuple(refs[:8]), *refs[8:])


def _kernel(len_ref, q_ref, qo_ref, idx_ref, kc_ref, ks_ref, kz_ref, ko_ref, vc_ref, vs_ref, vz_ref, vo_ref,
            o_ref, oo_ref, m_ref, l_ref, *scratch,
            lay: kq.KVLayout, bps: int, phase: int, inflight: int, omma: bool, stages: int, npad: int,
            split: bool = False, staged: bool = False,
            inplace: bool = False, loop_desc: bool = False, early: bool = False,
            qprep: float | None = None, ablate: frozenset = frozenset(), warp_mma: bool = False,
            merged: bool = False):
  """One program per CTA: b, h and split from the grid. ``scratch``: the ``_N_COMMON``
  buffers every program has, then (``split``: ``_Own``) its tile buffers, barriers and
  staging, then warp_mma's partials and the raw queries where they are used."""
  b, h, sp = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
  qraw = wred = None
  if qprep is not None:
    scratch, qraw = scratch[:-1], scratch[-1]
  if warp_mma:
    scratch, wred = scratch[:-1], scratch[-1]
  common, own = list(scratch[:_N_COMMON]) + [qraw], None
  if split:                      # one-barrier arrays -> barriers
    common[5] = common[5].at[0]
    own = _Own.of(scratch[_N_COMMON:])
    own = own._replace(kbar=own.kbar.at[0], vbar=own.vbar.at[0])
  _program(b, h, sp, len_ref, q_ref, qo_ref, idx_ref, kc_ref, ks_ref, kz_ref, ko_ref, vc_ref, vs_ref, vz_ref, vo_ref,
           o_ref, oo_ref, m_ref, l_ref, *common, lay=lay, bps=bps, phase=phase, inflight=inflight,
           omma=omma, stages=stages, npad=npad, staged=staged, inplace=inplace,
           loop_desc=loop_desc, early=early, qprep=qprep, ablate=ablate, own=own,
           warp_mma=warp_mma, wred=wred, merged=merged)


def _program(b, h, sp, len_ref, q_ref, qo_ref, idx_ref, kc_ref, ks_ref, kz_ref, ko_ref, vc_ref, vs_ref, vz_ref, vo_ref,
             o_ref, oo_ref, m_ref, l_ref,
             q_smem, qo_smem, p_smem, kmeta_smem, vmeta_smem, bar, kout_smem, vout_smem,
             kmult_smem, vmult_smem, qraw_smem,
             *, lay: kq.KVLayout, bps: int, phase: int, inflight: int, omma: bool, stages: int, npad: int,
             staged: bool = False, inplace: bool = False, loop_desc: bool = False,
             early: bool = False, qprep: float | None = None, ablate: frozenset = frozenset(),
             own: _Own | None = None, warp_mma: bool = False, wred=None, merged: bool = False):
  """With ``own`` the tiles are fetched by hand, one tile in flight in two halves: the next
  tile's keys as soon as this tile's key buffers are read (after the score MMAs), its values
  after the output MMAs. ``early``: as soon as the last phase has loaded a half's code
  words into registers, where nothing else reads that half's buffers after (staged outliers,
  none as rank-1 updates). Without ``own``, ``plgpu.emit_pipeline`` fetches whole tiles.
  ``qprep`` (the query scale): ``q_ref`` holds the raw queries ``[B, H, g, D]``, staged
  into the MMA operand here (``_stage_query``); else the operand itself. ``warp_mma``: each
  warp multiplies its own 16 tokens of every slot with mma.sync and keeps its own softmax
  state, combined over the warps once at the end (``wred [4 D_pad, N]`` f32 scratch).
  ``merged`` (warp_mma, early hand-fetched tiles, one phase per tile): each half's code words
  are loaded and its metadata staged before a single barrier, after which the next tile's
  half is fetched: two warpgroup barriers per tile instead of four.
  Without Pallas' automatic barriers (``explicit_barriers``) the commits below are the
  only ones, and they suffice: staged metadata and outliers are written before a commit
  and read after it; a raw tile buffer is read (codes, metadata to stage) before the commit
  that precedes the next copy into it, by which every thread has also waited for its
  mbarrier; a half's staged metadata is rewritten only after a commit of the other half
  that every warp reaches after its last read of it; the query and slot multipliers are
  committed once before the loop, the output partials before they are summed and copied."""
  cfg = lay.config
  bits, cpw, G = cfg.bits, lay.cpw, cfg.group_size
  dp, n_out, ng = lay.d_pad, lay.n_out, lay.n_groups_tok
  P = SLOT * cpw                                    # tokens per tile
  C = _chunk(P)                                     # token-minor arrays: [n, Cq // C, C] (TMA boxes <= 256)
  kr = max(1, P // G)                               # key-metadata rows per tile
  nq = lay.num_quantized(len_ref[b])                # tokens in the quantized region
  tile0 = sp * bps
  f32 = jnp.float32
  wl = plgpu.Layout.WGMMA
  n_fma = 0 if omma else n_out                      # outlier channels done as rank-1 updates
  p_tokens_minor = _p_tokens_minor(npad)
  lo_col, hi_col = lay.d_low, lay.d_low + n_out     # with omma: their place in the MMA padding
  # the raw tile buffers are dead once the codes are in registers: metadata and outliers are
  # read only from their staged copies
  early = bool(early and own is not None and staged and not n_fma)
  merged = bool(merged and warp_mma and early and phase >= cpw)
  timing_form = next((f for f in ("noshift", "fp2", "raw", "nometa") if f in ablate), "")   # timing only
  k_form = "raw" if "rawk" in ablate else timing_form                    # raw codes for one side only
  v_form = "raw" if "rawv" in ablate else timing_form
  plan = _read_plan(bits, cpw, phase) if inplace else None      # slot -> (rotation, bit position)
  slot_exps = None if plan is None else [10 - plan[j][1] for j in range(cpw)]   # scale multipliers

  _at_lowering(lambda: _descriptors_in_loop(loop_desc))
  specs = [
      plgpu.BlockSpec((SLOT, dp), lambda i: (tile0 + i, 0), transforms=_transforms(dp, 2)),   # k codes
      plgpu.BlockSpec((kr, dp), lambda i: (tile0 + i, 0)),                                     # k scale
      plgpu.BlockSpec((kr, dp), lambda i: (tile0 + i, 0)),                                     # k zero
      plgpu.BlockSpec((max(n_out, 1), P // C, C), lambda i: (0, tile0 + i, 0)),                # k outliers
      plgpu.BlockSpec((SLOT, dp), lambda i: (tile0 + i, 0), transforms=_transforms(dp, 2)),   # v codes
      plgpu.BlockSpec((ng, P // C, C), lambda i: (0, tile0 + i, 0)),                           # v scale
      plgpu.BlockSpec((ng, P // C, C), lambda i: (0, tile0 + i, 0)),                           # v zero
      plgpu.BlockSpec((max(n_out, 1), P // C, C), lambda i: (0, tile0 + i, 0)),                # v outliers
  ]
  at = lambda r: r.at[b, h]
  srcs = (at(kc_ref), at(ks_ref), at(kz_ref), at(ko_ref), at(vc_ref), at(vs_ref), at(vz_ref), at(vo_ref))

  def fetch(i, half):                    # own: half 0 key codes, metadata, outliers; 1 values
    for spec, src, buf in list(zip(specs, srcs, own.tiles))[4 * half:4 * half + 4]:
      blk = spec.index_map(i)
      idx = tuple(pl.ds(k * n, n) for k, n in zip(blk, spec.block_shape))
      plgpu.copy_gmem_to_smem(src.at[idx], buf, (own.kbar, own.vbar)[half])

  qbar = bar.at[0] if own is None else bar          # (own: already one barrier)
  plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem if qprep is None else qraw_smem, qbar)
  if n_fma:
    plgpu.copy_gmem_to_smem(qo_ref.at[b, h], qo_smem, qbar)
  if own is not None and "late_tile0" not in ablate:
    fetch(0, 0)                          # tile 0 in flight while the query arrives and is staged
    fetch(0, 1)
  plgpu.barrier_wait(qbar)
  if qprep is not None:
    _stage_query(qraw_smem, idx_ref.at[b, h], q_smem, dp=dp, d_low=lo_col, scale=qprep)
  q_out = [_ld(qo_smem, (o,), COL) for o in range(n_fma)]              # [npad] f32 each
  if plan is not None:     # read by other threads only after this barrier
    _fill_slot_multipliers(kmult_smem, unit=kmult_smem.shape[-1] * SLOT // G, exps=slot_exps)
    _fill_slot_multipliers(vmult_smem, unit=SLOT, exps=slot_exps)
  if qprep is not None or plan is not None:
    plgpu.commit_smem()

  rows = plgpu.broadcasted_iota(jnp.int32, (SLOT, npad), 0, layout=wl)
  bcol = lambda x, shape: lax.broadcast_in_dim(x, shape, [1])          # [npad] along columns
  brow = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])          # [SLOT] along rows

  def k_meta_index(j):
    # keys: rows are tokens (slot j, warp's 16 rows: one G-token group), columns channels
    return lambda mt, k, warp, quad: [_affine(j * SLOT, 16, warp, div=G), _affine(8 * k, 2, quad)]

  def v_meta_index(j):
    # v^T: rows are channels (one G-channel group per warp), columns the slot's tokens
    t0 = j * SLOT
    return lambda mt, k, warp, quad: [_affine(64 * mt, 16, warp, div=G, cap=ng - 1),
                                      _ix(t0 // C), _affine(t0 % C + 8 * k, 2, quad)]

  def v_meta_index_t(j):
    # warp_mma's v^T: register (k, half) holds channel 8 k + g and the slot's tokens
    # 16 warp + 8 half + 2 quad (+ 1): one pair per (channel group, half)
    t0 = j * SLOT
    return lambda mt, k, warp, quad, half: [
        _ix(min(8 * k // G, ng - 1)), _ix(t0 // C),
        arith.addi(_affine(t0 % C + 8 * half, 16, warp), arith.muli(_ix(2), quad))]

  v_meta_key_t = lambda mt, k, half: (min(8 * k // G, ng - 1), half)

  k_lo = lo_col - lo_col % 2                        # first column of kout_smem (even: pairs align)
  k_w = kout_smem.shape[-1]

  def key_patch(j):
    """Keys (rows = slot j's tokens): columns [d_low, d_low + n_out) take the outlier
    channels' 16-bit values, so the MMA adds their share of the scores. ``staged``: read as
    fp16 pairs from ``kout_smem [T, W]`` (columns ``k_lo + (0..W)``) and merged by a
    per-thread bit mask (one lop3)."""
    def patch_staged(mt, k, half, r, kout_ref, row, quad):
      if not (8 * k < hi_col and 8 * k + 8 > lo_col):
        return None
      t = arith.addi(row, _i32(j * SLOT + 8 * half))                  # token in the tile
      col = arith.addi(_i32(8 * k - k_lo), arith.muli(quad, _i32(2)))
      col = arith.minsi(arith.maxsi(col, _i32(0)), _i32(k_w - 2))    # pairs off the outliers: masked
      f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
      pair = mgpu_utils.bitcast(vector.load(f16x2, kout_ref, [_index(t), _index(col)]),
                                ir.IntegerType.get_signless(32))
      mask = _i32(0)
      for e in (0, 1):                                 # the halves that are outlier channels
        pred, _ = _in_range(arith.addi(arith.addi(_i32(8 * k), arith.muli(quad, _i32(2))), _i32(e)),
                            lo_col, hi_col)
        mask = arith.ori(mask, arith.select(pred, _i32(0xFFFF << (16 * e)), _i32(0)))
      return llvm.inline_asm(ir.IntegerType.get_signless(32), [r, pair, mask],
                             "lop3.b32 $0, $1, $2, $3, 0xd8;", "=r,r,r,r")    # mask ? pair : r

    def patch(mt, k, half, r, ko_ref, row, quad):
      if staged:
        return patch_staged(mt, k, half, r, ko_ref, row, quad)
      if not (8 * k < hi_col and 8 * k + 8 > lo_col):
        return None
      t = arith.addi(row, _i32(j * SLOT + 8 * half))                  # token in the tile
      ti = [_index(arith.divui(t, _i32(C))), _index(arith.remui(t, _i32(C)))]
      col0 = arith.addi(_i32(8 * k), arith.muli(quad, _i32(2)))
      sel = []
      for e in (0, 1):
        pred, o = _in_range(arith.addi(col0, _i32(e)), lo_col, hi_col)
        x = memref.load(ko_ref, [_index(o)] + ti)
        sel += [pred, _f16_bits(arith.extf(ir.F32Type.get(), x))]
      return _select_halves(*sel, r)
    return patch

  def value_patch(j):
    """v^T (rows = channels, columns = slot j's tokens): rows [d_low, d_low + n_out) take the
    outlier channels' values, so out^T's rows there are the outlier outputs. ``staged``: an
    fp16 pair of neighbouring tokens from ``vout_smem`` and one select."""
    def patch_staged(mt, k, half, r, vout_ref, row, quad):
      r0 = 64 * mt + 8 * half               # a thread's rows here: r0 + 16 warp + (0..7)
      if not (r0 < hi_col and r0 + 56 > lo_col):
        return None
      pred, o = _in_range(arith.addi(row, _i32(r0)), lo_col, hi_col)
      t0 = j * SLOT
      col = arith.addi(_i32(t0 % C + 8 * k), arith.muli(quad, _i32(2)))
      f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
      pair = mgpu_utils.bitcast(vector.load(f16x2, vout_ref, [_index(o), _ix(t0 // C), _index(col)]),
                                ir.IntegerType.get_signless(32))
      return arith.select(pred, pair, r)

    def patch(mt, k, half, r, vo_ref, row, quad):
      if staged:
        return patch_staged(mt, k, half, r, vo_ref, row, quad)
      if not (64 * mt < hi_col and 64 * mt + 64 > lo_col):
        return None
      bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
      channel = arith.addi(row, _i32(64 * mt + 8 * half))
      pred, o = _in_range(channel, lo_col, hi_col)
      t0 = j * SLOT
      col = arith.addi(_i32(t0 % C + 8 * k), arith.muli(quad, _i32(2)))
      pair = mgpu_utils.bitcast(vector.load(bf16x2, vo_ref, [_index(o), _ix(t0 // C), _index(col)]),
                                ir.IntegerType.get_signless(32))
      lo = _f16_bits(_bf16_bits_to_f32(pair))
      hi = _f16_bits(_bf16_bits_to_f32(arith.shrui(pair, _i32(16))))
      return _select_halves(pred, lo, pred, hi, r)
    return patch

  def value_patch_t(j):
    """warp_mma's v^T (register (k, half): channel 8 k + g, tokens 16 w + 8 half + 2 t (+ 1)):
    outlier channels take an fp16 pair of neighbouring tokens from ``vout_smem`` (staged)."""
    def patch(mt, k, half, r, vout_ref, row, quad):
      if not (8 * k < hi_col and 8 * k + 8 > lo_col):
        return None
      g = arith.andi(row, _i32(7))                     # row = 16 warp + g
      pred, o = _in_range(arith.addi(g, _i32(8 * k)), lo_col, hi_col)
      t0 = j * SLOT
      col = arith.addi(arith.addi(_i32(t0 % C + 8 * half), arith.subi(row, g)), arith.muli(quad, _i32(2)))
      f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
      pair = mgpu_utils.bitcast(vector.load(f16x2, vout_ref, [_index(o), _ix(t0 // C), _index(col)]),
                                ir.IntegerType.get_signless(32))
      return arith.select(pred, pair, r)
    return patch

  def stage_meta(*pairs, outliers=(), opening=True):
    """fp8/16-bit metadata of one tile -> (s * 2**bits, z - s * 2**bits) in fp16, in smem;
    pairs: (scales, zeros, destination) of keys and/or values; outliers (``staged``): the
    tile's key and/or value outlier buffers, staged as fp16 (``_stage_outliers``)."""
    if opening:    # every warp is done with the previous tile's copy (hand-fetched tiles: the
      plgpu.commit_smem()      # previous step's last fetch_next already synchronised)
    for src, is_key in outliers:
      if is_key:
        _stage_outliers(src, kout_smem, tokens_major=True, base=lo_col - k_lo)
      else:
        _stage_outliers(src, vout_smem, tokens_major=False)
    for src_s, src_z, dst in pairs:
      if plan is not None:           # s * 2**(10 - pos) of each element's slot: whole-array ops
        mult = (kmult_smem if dst is kmeta_smem else vmult_smem)[...].astype(jnp.float16)
        s2 = src_s[...].astype(jnp.float16) * mult
        dst[0] = s2
        dst[1] = src_z[...].astype(jnp.float16) - s2
        continue
      s2, z2 = _meta_pair(src_s[...], src_z[...], bits)
      dst[0] = s2
      dst[1] = z2
    plgpu.commit_smem()

  def tok_idx(j):                                   # token-minor index of slot j's 64 tokens
    return (j * SLOT // C, pl.ds(j * SLOT % C, SLOT))

  def key_scores(kc, ko, js, tbase, codes_loaded=None, kw=None):
    """Masked scores^T ``[64, npad]`` f32 of slots ``js`` (one per slot): the tile's key
    code words are read once (``codes_loaded()`` runs right after; ``kw``: already read),
    each slot dequantized in registers and multiplied by the query, the MMAs issued back
    to back."""
    if kw is None:
      kw = plgpu.load(kc, (), layout=wl)                                   # [64, dp] u16
    if codes_loaded is not None:
      codes_loaded()

    def k16_of(words, j):
      return _dequant(words, kmeta_smem, bits=bits, slot=j, meta_index=k_meta_index(j),
                      timing_form=k_form, pos=None if plan is None else plan[j][1],
                      patch_ref=kout_smem if staged else ko, patch=key_patch(j) if omma else None)

    def qk_warps():                           # warp_mma: each warp its own rows, mma.sync
      words, out = kw, []
      for j in js:
        if plan is not None and plan[j][0]:
          words = _rotate_words(words, plan[j][0])
        out.append(_warp_scores(k16_of(words, j), q_smem, npad=npad))
      return out

    def qk(*acc_refs):
      words = kw
      for a_ref, j in zip(acc_refs, js):
        if plan is not None and plan[j][0]:
          words = _rotate_words(words, plan[j][0])      # in place: the old words are dead
        k16 = k16_of(words, j)
        for _ in range(2 if "dblmma" in ablate else 1):      # timing only: the MMAs' own cost
          plgpu.wgmma(a_ref, k16, plgpu.transpose_ref(q_smem, (1, 0)))
        plgpu.wgmma_wait(inflight)            # MMAs left in flight while the next slot dequantizes
      return [a_ref[...] for a_ref in acc_refs]
    ss = qk_warps() if warp_mma else list(pl.run_scoped(qk, *[plgpu.ACC((SLOT, npad), f32) for _ in js]))
    for n, j in enumerate(js):
      s = ss[n]
      for o in range(0 if "out" in ablate else n_fma):
        s = s + brow(_ld(ko, (o,) + tok_idx(j), ROW), s.shape) * bcol(q_out[o], s.shape)
      ss[n] = jnp.where(tbase + j * SLOT + rows < nq, s, NEG)
    return ss

  def softmax_update(ss, js, m, l_rows, vo):
    """One online-softmax update over the scores of slots ``js`` (a single cross-warp max;
    the running sum stays distributed over rows): stores each slot's ``p`` as fp16 in
    ``p_smem[n]`` and returns the new (m, l_rows), the correction ``exp2(m_old - m)`` ``[npad]``
    and the rank-1 outlier terms ``p * v_out`` of each slot (n_fma only)."""
    s_max = functools.reduce(jnp.maximum, ss)
    if warp_mma:                  # per warp: m [64, npad], each warp's rows its own maxima
      m_new = jnp.maximum(m, _warp_colmax(s_max))
      corr = jnp.exp2(m - m_new)
      l_rows = l_rows * corr
      ps = []
      for s in ss:
        ps.append(jnp.exp2(s - m_new))
        l_rows = l_rows + ps[-1]
      return m_new, l_rows, corr, ps
    m_new = m if "max" in ablate else jnp.maximum(m, rows_max(s_max))
    corr = jnp.exp2(m - m_new)
    l_rows = l_rows * bcol(corr, l_rows.shape)
    terms = []
    for n, j in enumerate(js):
      p = jnp.exp2(ss[n] - bcol(m_new, ss[n].shape))
      l_rows = l_rows + p                    # summed over rows once, at the end
      if "out" not in ablate:
        terms.append([brow(_ld(vo, (o,) + tok_idx(j), ROW), p.shape) * p for o in range(n_fma)])
      if p_tokens_minor:                     # [npad, 64]: 16-byte rows of p^T cannot be swizzled
        _store_transposed(p.astype(jnp.float16), p_smem.at[n])
      else:
        p_smem[n] = p.astype(jnp.float16)
    return m_new, l_rows, corr, terms

  def value_mma(vc, vo, js, acc, codes_loaded=None):
    """``out^T [dp, npad] += v^T . p^T`` over slots ``js``: the tile's value code words read
    once, transposed (``codes_loaded()`` right after), each slot's ``v^T`` dequantized in
    the A-operand layout; ``p_smem[n]`` the slot's B operand."""
    vw = plgpu.layout_cast(
        plgpu.load(plgpu.transpose_ref(vc, (1, 0)), (), layout=plgpu.Layout.WGMMA_TRANSPOSED),
        wl)                                                                  # [dp, 64] u16
    if codes_loaded is not None:
      codes_loaded()

    def pv(acc_ref):
      words = vw
      for n, j in enumerate(js):
        if plan is not None and plan[j][0]:
          words = _rotate_words(words, plan[j][0])
        v16 = _dequant(words, vmeta_smem, bits=bits, slot=j, meta_index=v_meta_index(j),
                       timing_form=v_form, pos=None if plan is None else plan[j][1],
                       patch_ref=vout_smem if staged else vo,
                       patch=value_patch(j) if omma else None)
        pb = plgpu.transpose_ref(p_smem.at[n], (1, 0)) if p_tokens_minor else p_smem.at[n]
        for _ in range(2 if "dblmma" in ablate else 1):
          plgpu.wgmma(acc_ref, v16, pb)
        plgpu.wgmma_wait(inflight)
    return pl.run_state(pv)(plgpu.ACC.init(acc))

  def value_mma_warps(vc, js, acc, ps, codes_loaded=None, words=None):
    """warp_mma: ``acc [4 dp, npad] += v^T . p^T`` per warp over its own tokens (mma.sync);
    the value words are loaded as the key words and transposed in registers (``words``:
    already loaded)."""
    if words is None:
      words = value_words(vc)
    if codes_loaded is not None:
      codes_loaded()
    for n, j in enumerate(js):
      if plan is not None and plan[j][0]:
        words = _rotate_words(words, plan[j][0])
      v16 = _dequant(words, vmeta_smem, bits=bits, slot=j, meta_index=v_meta_index_t(j),
                     meta_key=v_meta_key_t, timing_form=v_form,
                     pos=None if plan is None else plan[j][1], patch_ref=vout_smem,
                     patch=value_patch_t(j) if omma else None)
      acc = _warp_pv(acc, v16, ps[n])
    return acc

  def value_words(vc):
    return _transpose_words(plgpu.load(vc, (), layout=wl))                # [64, dp] u16

  def merged_body(kc, ks, kz, ko, vc, vs, vz, vo, m, l_rows, acc, tbase, hooks):
    """One tile with two barriers: per half, the code words go to registers and the
    metadata is staged, then one barrier (stage_meta's closing commit), then the next
    tile's half is fetched. The value barrier also ends every warp's key reads, and the
    next tile's key barrier every warp's value reads, so staging may overwrite them."""
    js = range(cpw)
    with jax.named_scope("meta"):
      kw = plgpu.load(kc, (), layout=wl)
      stage_meta((ks, kz, kmeta_smem), outliers=((ko, True),), opening=False)
      hooks.keys_done(commit=False)
    with jax.named_scope("qk"):
      ss = key_scores(kc, ko, js, tbase, kw=kw)
    with jax.named_scope("softmax"):
      m, l_rows, corr, ps = softmax_update(ss, js, m, l_rows, vo)
    with jax.named_scope("vwait"):
      hooks.values_ready()
      vw = value_words(vc)
      stage_meta((vs, vz, vmeta_smem), outliers=((vo, False),), opening=False)
      hooks.values_done(commit=False)
    with jax.named_scope("pv"):
      acc = value_mma_warps(vc, js, _warp_scale(acc, corr), ps, words=vw)
    return m, l_rows, acc

  def body(idx, kc, ks, kz, ko, vc, vs, vz, vo, carry, hooks=None):
    """One tile. hooks (tiles fetched by hand in halves): ``keys_done()`` once the key buffers
    are read (the next tile's keys may come), ``values_ready()`` before the value buffers
    are first read (waits for them); the value metadata is then staged there."""
    (i,) = idx
    m, l_rows, acc, acc_vo = carry
    tbase = (tile0 + i) * P
    if merged:
      return (*merged_body(kc, ks, kz, ko, vc, vs, vz, vo, m, l_rows, acc, tbase, hooks), acc_vo)
    with jax.named_scope("meta"):     # a region in profile traces
      if hooks is None:
        stage_meta((ks, kz, kmeta_smem), (vs, vz, vmeta_smem),
                   outliers=((ko, True), (vo, False)) if staged else ())
      else:
        stage_meta((ks, kz, kmeta_smem), outliers=((ko, True),) if staged else (), opening=False)
    for j0 in range(0, cpw, phase):
      js = range(j0, min(j0 + phase, cpw))
      last = j0 + phase >= cpw
      with jax.named_scope("qk"):     # a region in profile traces
        # the code words hold every slot of the tile: one shared-memory read per phase
        ss = key_scores(kc, ko, js, tbase,
                        hooks.keys_done if early and hooks is not None and last else None)
      if hooks is not None and last and not early:
        hooks.keys_done()
      if hooks is not None and j0 == 0:
        with jax.named_scope("vwait"):
          hooks.values_ready()
          stage_meta((vs, vz, vmeta_smem), outliers=((vo, False),) if staged else (), opening=False)

      with jax.named_scope("softmax"):     # a region in profile traces
        m, l_rows, corr, terms = softmax_update(ss, js, m, l_rows, vo)
      if warp_mma:
        with jax.named_scope("pv"):
          acc = value_mma_warps(vc, js, _warp_scale(acc, corr), terms,
                                hooks.values_done if early and last else None)
        continue
      with jax.named_scope("softmax"):
        acc = acc * bcol(corr, acc.shape)
        acc_vo = [a * bcol(corr, a.shape) for a in acc_vo]
        for term in terms:
          acc_vo = [a + t for a, t in zip(acc_vo, term)]
        plgpu.commit_smem()

      with jax.named_scope("pv"):     # a region in profile traces
        # --- phase 2: out^T [dp, npad] += v^T . p^T, v^T dequantized in the A-operand layout
        acc = value_mma(vc, vo, js, acc,
                        hooks.values_done if early and hooks is not None and last else None)
    return m, l_rows, acc, acc_vo

  rows_max, rows_sum = (lambda x: x.max(axis=0)), (lambda x: x.sum(axis=0))

  zeros_sq = lambda: plgpu.layout_cast(jnp.zeros((SLOT, npad), f32), wl)
  init = (
      _col(jnp.full((npad,), NEG, f32)),
      zeros_sq(),
      plgpu.layout_cast(jnp.zeros((dp, npad), f32), wl),
      [zeros_sq() for _ in range(n_fma)],
  )
  if warp_mma:             # per-warp running maxima [64, npad]; acc row 64 mi + 16 w + r: warp w's
    init = (plgpu.layout_cast(jnp.full((SLOT, npad), NEG, f32), wl), zeros_sq(),   # channel 16 mi + r
            plgpu.layout_cast(jnp.zeros((4 * dp, npad), f32), wl), [])
  if own is None:
    m, l_rows, acc, acc_vo = plgpu.emit_pipeline(
        body, grid=(bps,), in_specs=specs, max_concurrent_steps=stages, init_carry=init)(*srcs)
  else:
    bufs, kbar, vbar = own.tiles, own.kbar, own.vbar

    def fetch_next(i, half, commit=True):
      if commit:                         # (else the caller's last commit_smem did it)
        plgpu.commit_smem()              # every warp is done with these buffers

      @pl.when(i + 1 < bps)
      def _():
        fetch(i + 1, half)

    class Hooks:
      def __init__(self, i):
        self.i = i

      def keys_done(self, commit=True):
        fetch_next(self.i, 0, commit)

      def values_ready(self):
        plgpu.barrier_wait(vbar)

      def values_done(self, commit=True):
        fetch_next(self.i, 1, commit)

    if "late_tile0" in ablate:         # timing only: tile 0 fetched after the prologue
      fetch(0, 0)
      fetch(0, 1)

    def step(i, carry):
      with jax.named_scope("kwait"):     # a region in profile traces
        plgpu.barrier_wait(kbar)
      carry = body((i,), *bufs, carry, hooks=Hooks(i))
      if not early:
        fetch_next(i, 1)
      return carry
    m, l_rows, acc, acc_vo = lax.fori_loop(0, bps, step, init)

  def store(o_smem, oo_smem, ml_smem):
    if warp_mma:           # the four warps' partials, combined: rescaled to the common maximum, summed
      m_all = rows_max(m)
      scale = jnp.exp2(m - bcol(m_all, m.shape))
      wred[...] = _warp_scale(acc, scale)
      ml_smem[0] = m_all
      ml_smem[1] = rows_sum(l_rows * scale)
      plgpu.commit_smem()
      _sum_warps(wred, o_smem)
    else:
      o_smem[...] = acc
      for o in range(n_fma):
        oo_smem[o] = rows_sum(acc_vo[o])
      ml_smem[0] = m
      ml_smem[1] = rows_sum(l_rows)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, sp])
    if n_fma:
      plgpu.copy_smem_to_gmem(oo_smem, oo_ref.at[b, h, sp])
    plgpu.copy_smem_to_gmem(ml_smem.at[0], m_ref.at[b, h, sp])
    plgpu.copy_smem_to_gmem(ml_smem.at[1], l_ref.at[b, h, sp])
    plgpu.wait_smem_to_gmem(0)
  with jax.named_scope("store"):
    if own is None:       # output staging reuses the pipeline's shared memory (allocated after it)
      nop = oo_ref.shape[3]
      pl.run_scoped(store, plgpu.SMEM((dp, npad), f32), plgpu.SMEM((nop, npad), f32),
                    plgpu.SMEM((2, npad), f32))
    else:
      store(own.o, own.oo, own.ml)


def _choose_splits(n_tiles, batch_heads, num_splits):
  if num_splits is None:
    num_splits = max(1, -(-_TARGET_PROGRAMS // batch_heads))
  num_splits = max(1, min(int(num_splits), n_tiles))
  # a divisor of n_tiles, so every split's pipeline stays inside the cache
  while n_tiles % num_splits:
    num_splits -= 1
  return num_splits, n_tiles // num_splits


def _warp_mma_applies(split_fetch: bool, n_out: int, omma: bool, staged_outliers: bool) -> bool:
  """Whether ``warp_mma`` can run with these options: tiles fetched by hand, and any
  outliers staged into the MMA's columns."""
  return bool(split_fetch) and (not n_out or bool(omma and staged_outliers))


def _split_in_mma(lay: kq.KVLayout, outliers_in_mma: bool) -> bool:
  """Whether the kernel's value output is the whole split form (outlier channels as MMA
  columns ``[d_low, d_low + n_out)``), or there are no outlier channels."""
  return not lay.n_out or bool(outliers_in_mma and lay.d_low + lay.n_out <= lay.d_pad)


def quantized_partials(qg, kv: kq.QuantizedKV, *, num_splits=None, phase_slots=PHASE_SLOTS,
                       inflight=1, outliers_in_mma=True, stages=STAGES, heads_pad=None,
                       split_fetch=SPLIT_FETCH,
                       staged_outliers=STAGED_OUTLIERS, in_place_codes=IN_PLACE_CODES,
                       loop_descriptors=LOOP_DESCRIPTORS, early_fetch=EARLY_FETCH, profile_dir="",
                       ablate=frozenset(), heads_minor=False, raw_query=None, raw_scale=None,
                       warp_mma=None, merged_barriers=MERGED_BARRIERS,
                       explicit_barriers=EXPLICIT_BARRIERS):
  """Kernel partials over the quantized region.

  qg: ``[B, H, g, D]`` float32 queries, already scaled by ``sm_scale * log2(e)``.
  Returns (m, l ``[B, H, NS, g]``, o_lo ``[B, H, NS, g, D_pad]`` (low channels in
  cache order), o_out ``[B, H, NS, g, n_out]``), unnormalized, log2 units. With
  ``heads_minor`` (only where ``_split_in_mma``: the outliers' outputs are columns of the
  MMA), the kernel's own outputs: m, l ``[B, H, NS, N]``, o ``[B, H, NS, D_pad, N]`` (``N``
  padded query heads; channels in split order), as ``decode_merge_gpu`` takes them.
  ``raw_query`` ``[B, H, g, D]`` (unscaled, any float dtype) with ``raw_scale`` (``sm_scale
  * log2(e)``): where the outliers' query goes into the MMA, the kernel builds its query
  operand from these itself (``qg`` then only gives shapes): no XLA kernels before it.
  """
  lay = kv.layout
  f32 = jnp.float32
  b, h, g, d = qg.shape
  npad = heads_pad or (8 if g <= 8 else NQ)      # the MMAs' N: query heads, padded
  dp, n_out = lay.d_pad, lay.n_out
  n_tiles = lay.cq // (SLOT * lay.cpw)
  ns, bps = _choose_splits(n_tiles, b * h, num_splits)
  phase = lay.cpw if phase_slots is None else max(1, min(int(phase_slots), lay.cpw))
  omma = bool(outliers_in_mma and n_out) and _split_in_mma(lay, outliers_in_mma)
  if heads_minor and not _split_in_mma(lay, outliers_in_mma):
    raise ValueError("heads_minor needs the outlier channels inside the MMA (outliers_in_mma "
                     f"and d_low + n_out <= d_pad; got n_out={n_out}, d_pad={dp})")
  kr = max(1, SLOT * lay.cpw // lay.config.group_size)
  nop = _NOP(n_out)
  q_out = np.zeros((1, 1, nop, npad), np.float32)     # unread unless rank-1 outlier updates; a literal
  idx_in = np.zeros((b, h, 1), np.int32)              # unread unless the kernel builds the query
  qprep = None
  if raw_query is not None and (omma or not n_out):
    if raw_scale is None or raw_query.shape != qg.shape:
      raise ValueError(f"raw_query must have qg's shape {qg.shape} (got {raw_query.shape}) "
                       f"and come with raw_scale (got {raw_scale})")
    qprep, q_lo = float(raw_scale), raw_query         # the kernel builds its operand (_stage_query)
    if n_out:
      idx_in = kv.k_outlier_idx.astype(jnp.int32)
  else:                                               # the operand, built in XLA
    lo_idx = kq.low_channel_index(kv.k_outlier_idx, d)
    if omma or not n_out:         # the outlier channels' query goes in the MMA's padding:
      split = jnp.concatenate([lo_idx, kv.k_outlier_idx.astype(jnp.int32)], axis=-1)   # one gather
      q_lo = jnp.take_along_axis(qg, jnp.broadcast_to(split, (b, h, d))[:, :, None, :], axis=3)
    else:
      q_lo = jnp.take_along_axis(qg, lo_idx[:, :, None, :], axis=3)
      q_out = jnp.take_along_axis(qg, kv.k_outlier_idx[:, :, None, :], axis=3)     # [B,H,g,n_out]
      q_out = jnp.pad(jnp.swapaxes(q_out, 2, 3), [(0, 0), (0, 0), (0, nop - n_out), (0, npad - g)])
    q_lo = jnp.pad(q_lo, [(0, 0), (0, 0), (0, npad - g), (0, dp - q_lo.shape[3])]).astype(jnp.float16)
  ko, vo = kv.k_outliers, kv.v_outliers
  if not n_out:
    ko = vo = jnp.zeros((b, h, 1, lay.cq), jnp.bfloat16)
  c = _chunk(SLOT * lay.cpw)
  tm = lambda x: x.reshape(x.shape[:3] + (x.shape[3] // c, c))      # token-minor: [.., n, Cq/C, C]

  out_types = (
      jax.ShapeDtypeStruct((b, h, ns, dp, npad), f32),
      jax.ShapeDtypeStruct((b, h, ns, nop, npad), f32),
      jax.ShapeDtypeStruct((b, h, ns, npad), f32),
      jax.ShapeDtypeStruct((b, h, ns, npad), f32),
  )
  if stages != 1 and split_fetch:
    raise ValueError(f"stages={stages} needs the whole-tile pipeline: split_fetch=False (got "
                     f"split_fetch={split_fetch}); the hand-written fetch keeps one tile in flight")
  wm_ok = _warp_mma_applies(split_fetch, n_out, omma, staged_outliers)
  wm = WARP_MMA and wm_ok if warp_mma is None else bool(warp_mma)
  if wm and not wm_ok:
    raise ValueError("warp_mma needs split_fetch and the outliers staged in the "
                     f"MMA (got split_fetch={split_fetch}, "
                     f"outliers_in_mma={omma}, staged_outliers={staged_outliers})")
  smem = plgpu.SMEM
  scratch = [
      smem((npad, dp), jnp.float16, transforms=_transforms(dp, 2)),
      smem((nop, npad), f32),
      (smem((2, 8), jnp.float16) if wm                 # unused: warp_mma keeps p in registers
       else smem((phase, npad, SLOT), jnp.float16, transforms=_transforms(SLOT, 2)) if _p_tokens_minor(npad)
       else smem((phase, SLOT, npad), jnp.float16, transforms=_transforms(npad, 2))),
      smem((2, kr, dp), jnp.float16),                                   # key s2, z2 (staged)
      smem((2, lay.n_groups_tok, SLOT * lay.cpw // c, c), jnp.float16), # value s2, z2
      plgpu.Barrier(num_barriers=1, num_arrivals=1 + (n_out > 0 and not omma)),
  ]
  staged = bool(omma and staged_outliers)
  # in place: each key group must lie in one slot (its staged scale carries that slot's multiplier)
  inplace = bool(in_place_codes and lay.config.group_size <= SLOT)
  tile = SLOT * lay.cpw
  if staged:                     # fp16 outliers of a tile: keys [T, W] (their columns, from an even one), values
    k_lo, k_hi = lay.d_low - lay.d_low % 2, lay.d_low + n_out
    scratch += [smem((tile, k_hi - k_lo + k_hi % 2), jnp.float16), smem((n_out, tile // c, c), jnp.float16)]
  else:
    scratch += [smem((2, 8), jnp.float16), smem((2, 8), jnp.float16)]       # unused
  if inplace:                   # per-element slot multipliers of the staged scales (keys, values)
    scratch += [smem((kr, dp), kv.k_scale.dtype), smem((lay.n_groups_tok, tile // c, c), kv.v_scale.dtype)]
  else:
    scratch += [smem((2, 8), jnp.float16), smem((2, 8), jnp.float16)]       # unused
  assert len(scratch) == _N_COMMON
  args = (kv.lengths.astype(jnp.int32), q_lo, q_out, idx_in, kv.k_codes, kv.k_scale, kv.k_zero, tm(ko),
          kv.v_codes, tm(kv.v_scale), tm(kv.v_zero), tm(vo))
  if split_fetch:                # this program's _Own buffers: tiles (as the block specs), barriers, staging
    blocks = [((SLOT, dp), _transforms(dp, 2)), ((kr, dp), ()), ((kr, dp), ()),
              ((ko.shape[2], tile // c, c), ()), ((SLOT, dp), _transforms(dp, 2)),
              ((lay.n_groups_tok, tile // c, c), ()), ((lay.n_groups_tok, tile // c, c), ()),
              ((vo.shape[2], tile // c, c), ())]
    scratch += [smem(shape, x.dtype, transforms=tr) for (shape, tr), x in zip(blocks, args[4:])]
    scratch += [plgpu.Barrier(num_barriers=1, num_arrivals=4), plgpu.Barrier(num_barriers=1, num_arrivals=4),
                smem((dp, npad), f32), smem((nop, npad), f32), smem((2, npad), f32)]
  if wm:
    scratch.append(smem((4 * dp, npad), f32))               # the warps' partials, combined at the end
  if qprep is not None:
    scratch.append(smem((g, d), q_lo.dtype))                # the raw queries (last)
  grid = dict(grid=(b, h, ns), grid_names=("b", "h", "s"))
  # profile_dir: Mosaic's on-device profiler writes one trace per call there (regions "meta",
  # "kwait", "qk", "vwait", "softmax", "pv", "store" of every program, timed by warp 0 of each warpgroup)
  n_ranges = bps * (3 + 3 * -(-lay.cpw // phase)) + 8     # per tile: kwait, meta, vwait; 3 per phase
  prof = dict(profile_space=2 * n_ranges, profile_dir=profile_dir) if profile_dir else {}
  kern = plgpu.kernel(
      functools.partial(_kernel, lay=lay, bps=bps, phase=phase, inflight=inflight, omma=omma,
                        stages=stages, npad=npad, split=bool(split_fetch),
                        staged=staged, inplace=inplace, loop_desc=bool(loop_descriptors),
                        early=bool(early_fetch), qprep=qprep, ablate=ablate, warp_mma=wm,
                        merged=bool(merged_barriers)),
      out_type=out_types, scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=1024,
                                           unsafe_no_auto_barriers=bool(wm and explicit_barriers),
                                           **prof), **grid,
  )
  o_lo, o_out, m, l = kern(*args)
  if heads_minor:
    return m, l, o_lo
  o_lo = jnp.swapaxes(o_lo, 3, 4)[:, :, :, :g]
  if omma:
    o_out = o_lo[..., lay.d_low:lay.d_low + n_out]
  else:
    o_out = jnp.swapaxes(o_out, 3, 4)[:, :, :, :g, :n_out]
  return m[..., :g], l[..., :g], o_lo, o_out


@functools.partial(jax.jit, static_argnames=("sm_scale", "num_splits", "phase_slots", "inflight",
                                             "outliers_in_mma", "stages", "heads_pad",
                                             "split_fetch",
                                             "staged_outliers", "in_place_codes", "loop_descriptors",
                                             "early_fetch", "profile_dir", "ablate", "merge_kernel",
                                             "warp_mma", "merged_barriers", "explicit_barriers"))
def decode_attention_mgpu(q, kv: kq.QuantizedKV, *, sm_scale: float, num_splits=None,
                          phase_slots=PHASE_SLOTS, inflight=1, outliers_in_mma=True, stages=STAGES,
                          heads_pad=None,
                          split_fetch=SPLIT_FETCH, staged_outliers=STAGED_OUTLIERS,
                          in_place_codes=IN_PLACE_CODES, loop_descriptors=LOOP_DESCRIPTORS,
                          early_fetch=EARLY_FETCH, profile_dir="", ablate: frozenset = frozenset(),
                          merge_kernel=True, warp_mma=None, merged_barriers=MERGED_BARRIERS,
                          explicit_barriers=EXPLICIT_BARRIERS):
  """``[B, Hq, D]`` attention output; see the module docstring. Call through
  ``decode_attention(..., backend="mosaic")`` or check ``supports`` first.
  ``merge_kernel``: sinks, window and the split merge in ``decode_merge_gpu``'s kernel
  (False: the ``jnp`` merge, ``decode_merge.merge_partials``)."""
  qg = scaled_queries(q, kv.num_heads, sm_scale)
  opts = dict(num_splits=num_splits, phase_slots=phase_slots, inflight=inflight,
              outliers_in_mma=outliers_in_mma, stages=stages, heads_pad=heads_pad,
              split_fetch=split_fetch,
              staged_outliers=staged_outliers, in_place_codes=in_place_codes,
              loop_descriptors=loop_descriptors, early_fetch=early_fetch, profile_dir=profile_dir,
              ablate=ablate, warp_mma=warp_mma, merged_barriers=merged_barriers,
              explicit_barriers=explicit_barriers)
  if merge_kernel and _split_in_mma(kv.layout, outliers_in_mma):
    # window, merge and channel order in one Triton kernel (as XLA ops: ~7 small kernels)
    # (the merge scales the raw query and writes q.dtype itself: two XLA kernels fewer)
    m, l, o = quantized_partials(qg, kv, heads_minor=True, raw_query=q.reshape(qg.shape),
                                 raw_scale=sm_scale * LOG2E, **opts)
    return merge_heads_minor(q.reshape(qg.shape), kv, m, l, o, interpret=False,
                             q_scale=sm_scale * LOG2E, out_dtype=q.dtype).reshape(q.shape)
  out = merge_partials(qg, kv, *quantized_partials(qg, kv, **opts))
  return out.reshape(q.shape).astype(q.dtype)
