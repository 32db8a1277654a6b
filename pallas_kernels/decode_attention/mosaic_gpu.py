"""Quantized-KV decode attention for Hopper GPUs, written with Pallas' Mosaic GPU backend.

The same function as the other implementations (one query token per sequence against a
``QuantizedKV``), laid out so that the tensor cores see no padding on the token axis and
the dequantized tiles never leave registers:

* One warpgroup (128 threads) per program ``(b, n, split)``; two programs share an SM.
  Each step handles one ``[64, D_pad]`` tile of uint16 code words for keys and one for
  values (``cpw`` slots of 64 consecutive tokens: 512 tokens at 2 bits), fetched by hand
  with TMA in two halves: the next tile's keys as soon as this tile's key words are in
  registers, its values likewise (tile 0 is requested before the program waits for its
  query), one tile in flight.
* The query operand (scaled, channels in the cache's split order, padded) is built in the
  kernel from the raw queries (``stage_query``), the quantized token count from the
  lengths: no XLA kernel runs before it.
* Once per tile the metadata is staged in shared memory as the fp16 operands of the
  dequantizing fma (``stage_meta``), the outlier values as fp16 (``stage_outliers``).
* Each warp multiplies its own 16 tokens of every slot with ``mma.sync``
  (``warp_scores``): scores^T ``[64, N] = k . q^T`` with the query heads of one kv-head as
  N (8, or 16 above 8 heads), keys dequantized in registers (``dequant``; codes read where
  an in-place rotation left them, ``read_plan``, for group sizes up to one slot). Each warp
  keeps its own online-softmax state; ``p`` becomes a B operand in registers
  (``movmatrix``), value words are transposed per 8x8 block in registers, and
  ``out^T += v^T . p^T`` runs per warp (``warp_pv``). The four warps' partials are combined
  once at the end.
* Outlier channels (at most four) take the MMA's padding columns: their fp16 values replace
  the dequantized registers of those key columns and ``v^T`` rows, and the query's outlier
  channels sit in the same columns, so the tensor cores do that work.
* Sinks, the full-precision window and the merge of the splits' partials run in one
  Triton kernel after this one (``merge_triton.merge_heads_minor``).

Supported (``supports``): keys per channel and values per token (KIVI's assignment),
``D_pad`` a multiple of 64, ``group_size`` >= 32 dividing the 64-token slot or a multiple of
it (and dividing the tile), at most 4 outlier channels, at most 16 query heads per kv-head;
compiled on sm_90 only (no interpret mode). Measured variants that lost are in
docs/benchmarks.md ("tried and refuted").
"""
from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, vector
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from pallas_kernels import _implementation as impl_lib
from pallas_kernels._implementation import Unsupported
from pallas_kernels.decode_attention import mosaic_gpu_ptx as ptx
from pallas_kernels.decode_attention import mosaic_gpu_smem as smem_ops
from pallas_kernels.decode_attention.mosaic_gpu_plan import (  # noqa: F401  (re-exported)
    MAX_HEADS, MAX_OUTLIERS, SLOT, MosaicGpuConfig, supports, unsupported_reason)
from pallas_kernels.decode_attention.merge import LOG2E, NEG
from pallas_kernels.decode_attention.merge_triton import merge_heads_minor
from pallas_kernels.kv import layout as kl
from pallas_kernels.kv.quant import QuantizedKV

_TILE_BUFFERS = ("k_codes", "k_scale", "k_zero", "k_outliers", "v_codes", "v_scale", "v_zero",
                 "v_outliers")   # one tile's shared buffers, in the order of the block specs


def _kernel(len_ref, q_ref, idx_ref, kc_ref, ks_ref, kz_ref, ko_ref, vc_ref, vs_ref, vz_ref,
            vo_ref, o_ref, m_ref, l_ref, *scratch, names: tuple, lay: kl.KVLayout, bps: int,
            npad: int, staged: bool, inplace: bool, q_scale: float):
  """One program per CTA: b, n and split from the grid; ``scratch`` its shared buffers and
  barriers, named by ``names`` (``_partials``)."""
  b, h, sp = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
  smem = dict(zip(names, scratch))
  for bar in ("q_bar", "k_bar", "v_bar"):          # one-barrier arrays -> barriers
    smem[bar] = smem[bar].at[0]
  program = _Program(lay=lay, bps=bps, npad=npad, staged=staged, inplace=inplace, q_scale=q_scale,
                     b=b, h=h, sp=sp, refs=(len_ref, q_ref, idx_ref, kc_ref, ks_ref, kz_ref, ko_ref,
                                            vc_ref, vs_ref, vz_ref, vo_ref, o_ref, m_ref, l_ref),
                     smem=smem)
  program.run()


class _Program:
  """The body of one program, split into the steps of one tile (see the module docstring).

  Without outliers (``staged`` False) a half's next tile is fetched after its MMAs, with
  them as soon as its code words are in registers (``early``)."""

  def __init__(self, *, lay, bps, npad, staged, inplace, q_scale, b, h, sp, refs, smem):
    self.lay, self.bps, self.npad, self.staged = lay, bps, npad, staged
    self.q_scale, self.b, self.h, self.sp = q_scale, b, h, sp
    (self.len_ref, self.q_ref, self.idx_ref, kc, ks, kz, ko, vc, vs, vz, vo,
     self.o_ref, self.m_ref, self.l_ref) = refs
    self.smem = smem
    self.tiles = tuple(smem[n] for n in _TILE_BUFFERS)
    self.q_smem, self.kmeta_smem, self.vmeta_smem = smem["q_op"], smem["k_meta"], smem["v_meta"]
    self.kout_smem, self.vout_smem = smem.get("k_out"), smem.get("v_out")
    self.kmult_smem, self.vmult_smem = smem.get("k_mult"), smem.get("v_mult")
    cfg = lay.config
    self.bits, self.cpw, self.G = cfg.bits, lay.cpw, cfg.group_size
    self.dp, self.n_out, self.ng = lay.d_pad, lay.n_out, lay.n_groups_tok
    self.P = SLOT * self.cpw                       # tokens per tile
    self.C = ptx.chunk(self.P)                     # token-minor arrays: [n, Cq // C, C]
    self.kr = max(1, self.P // self.G)             # key-metadata rows per tile
    self.nq = lay.num_quantized(self.len_ref[b])   # tokens in the quantized region
    self.tile0 = sp * bps
    self.lo_col, self.hi_col = lay.d_low, lay.d_low + self.n_out   # outliers' MMA columns
    self.early = staged       # the raw tile buffers are dead once the codes are in registers
    self.plan = ptx.read_plan(self.bits, self.cpw) if inplace else None
    self.slot_exps = None if self.plan is None else [10 - self.plan[j][1] for j in range(self.cpw)]
    self.k_lo = self.lo_col - self.lo_col % 2      # first column of kout_smem (even: pairs align)
    self.k_w = self.kout_smem.shape[-1] if staged else 0
    dp, kr, ng, P, C = self.dp, self.kr, self.ng, self.P, self.C
    t0 = lambda i: self.tile0 + i
    self.specs = [
        plgpu.BlockSpec((SLOT, dp), lambda i: (t0(i), 0), transforms=ptx.transforms(dp, 2)),  # k codes
        plgpu.BlockSpec((kr, dp), lambda i: (t0(i), 0)),                                      # k scale
        plgpu.BlockSpec((kr, dp), lambda i: (t0(i), 0)),                                      # k zero
        plgpu.BlockSpec((max(self.n_out, 1), P // C, C), lambda i: (0, t0(i), 0)),            # k outliers
        plgpu.BlockSpec((SLOT, dp), lambda i: (t0(i), 0), transforms=ptx.transforms(dp, 2)),  # v codes
        plgpu.BlockSpec((ng, P // C, C), lambda i: (0, t0(i), 0)),                            # v scale
        plgpu.BlockSpec((ng, P // C, C), lambda i: (0, t0(i), 0)),                            # v zero
        plgpu.BlockSpec((max(self.n_out, 1), P // C, C), lambda i: (0, t0(i), 0)),            # v outliers
    ]
    self.srcs = tuple(r.at[b, h] for r in (kc, ks, kz, ko, vc, vs, vz, vo))

  # --- fetching ---------------------------------------------------------------------------

  def fetch(self, i, half):
    """Tile i's key half (codes, scale, zero, outliers: half 0) or value half (1)."""
    for spec, src, buf in list(zip(self.specs, self.srcs, self.tiles))[4 * half:4 * half + 4]:
      blk = spec.index_map(i)
      idx = tuple(pl.ds(k * n, n) for k, n in zip(blk, spec.block_shape))
      plgpu.copy_gmem_to_smem(src.at[idx], buf, self.smem[("k_bar", "v_bar")[half]])

  def fetch_next(self, i, half):
    plgpu.commit_smem()              # every warp is done with these buffers

    @pl.when(i + 1 < self.bps)
    def _():
      self.fetch(i + 1, half)

  # --- prologue ---------------------------------------------------------------------------

  def prologue(self):
    plgpu.copy_gmem_to_smem(self.q_ref.at[self.b, self.h], self.smem["q_raw"], self.smem["q_bar"])
    self.fetch(0, 0)                 # tile 0 in flight while the query arrives and is staged
    self.fetch(0, 1)
    plgpu.barrier_wait(self.smem["q_bar"])
    smem_ops.stage_query(self.smem["q_raw"], self.idx_ref.at[self.b, self.h], self.q_smem, dp=self.dp,
                         d_low=self.lo_col, scale=self.q_scale)
    if self.plan is not None:        # read by other threads only after the commit below
      smem_ops.fill_slot_multipliers(self.kmult_smem, unit=self.kmult_smem.shape[-1] * SLOT // self.G,
                                     exps=self.slot_exps)
      smem_ops.fill_slot_multipliers(self.vmult_smem, unit=SLOT, exps=self.slot_exps)
    plgpu.commit_smem()

  # --- per tile ---------------------------------------------------------------------------

  def stage_meta(self, src_s, src_z, dst, outliers):
    """One half's fp8/16-bit metadata -> (s * 2**bits, z - s * 2**bits) in fp16, in smem;
    with outliers, the tile's outlier buffer staged as fp16 (``stage_outliers``)."""
    if outliers is not None:
      src, is_key = outliers
      if is_key:
        smem_ops.stage_outliers(src, self.kout_smem, tokens_major=True, base=self.lo_col - self.k_lo)
      else:
        smem_ops.stage_outliers(src, self.vout_smem, tokens_major=False)
    if self.plan is not None:        # s * 2**(10 - pos) of each element's slot: whole-array ops
      mult = (self.kmult_smem if dst is self.kmeta_smem else self.vmult_smem)[...].astype(jnp.float16)
      s2 = src_s[...].astype(jnp.float16) * mult
      dst[0] = s2
      dst[1] = src_z[...].astype(jnp.float16) - s2
    else:
      s2, z2 = ptx.meta_pair(src_s[...], src_z[...], self.bits)
      dst[0] = s2
      dst[1] = z2
    plgpu.commit_smem()

  def k_meta_index(self, j):
    # keys: rows are tokens (slot j, warp's 16 rows: one G-token group), columns channels
    return lambda mt, k, warp, quad: [ptx.affine(j * SLOT, 16, warp, div=self.G),
                                      ptx.affine(8 * k, 2, quad)]

  def v_meta_index(self, j):
    # v^T: register (k, half) holds channel 8 k + g and the slot's tokens
    # 16 warp + 8 half + 2 quad (+ 1): one pair per (channel group, half)
    t0, C, ng, G = j * SLOT, self.C, self.ng, self.G
    return lambda mt, k, warp, quad, half: [
        ptx.as_index(min(8 * k // G, ng - 1)), ptx.as_index(t0 // C),
        arith.addi(ptx.affine(t0 % C + 8 * half, 16, warp), arith.muli(ptx.as_index(2), quad))]

  def v_meta_key(self, mt, k, half):
    return (min(8 * k // self.G, self.ng - 1), half)

  def key_patch(self, j):
    """Keys (rows = slot j's tokens): columns [d_low, d_low + n_out) take the outlier
    channels' fp16 values, read as pairs from ``kout_smem [T, W]`` (columns ``k_lo + (0..W)``)
    and merged by a per-thread bit mask (one lop3)."""
    lo_col, hi_col, k_lo, k_w = self.lo_col, self.hi_col, self.k_lo, self.k_w
    i32c = ptx.const_i32

    def patch(mt, k, half, r, kout_ref, row, quad):
      if not (8 * k < hi_col and 8 * k + 8 > lo_col):
        return None
      t = arith.addi(row, i32c(j * SLOT + 8 * half))                   # token in the tile
      col = arith.addi(i32c(8 * k - k_lo), arith.muli(quad, i32c(2)))
      col = arith.minsi(arith.maxsi(col, i32c(0)), i32c(k_w - 2))    # pairs off the outliers: masked
      f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
      pair = mgpu_utils.bitcast(vector.load(f16x2, kout_ref, [ptx.to_index(t), ptx.to_index(col)]),
                                ir.IntegerType.get_signless(32))
      mask = i32c(0)
      for e in (0, 1):                                 # the halves that are outlier channels
        pred, _ = ptx.in_range(arith.addi(arith.addi(i32c(8 * k), arith.muli(quad, i32c(2))), i32c(e)),
                               lo_col, hi_col)
        mask = arith.ori(mask, arith.select(pred, i32c(0xFFFF << (16 * e)), i32c(0)))
      return llvm.inline_asm(ir.IntegerType.get_signless(32), [r, pair, mask],
                             "lop3.b32 $0, $1, $2, $3, 0xd8;", "=r,r,r,r")    # mask ? pair : r
    return patch

  def value_patch(self, j):
    """v^T (register (k, half): channel 8 k + g, tokens 16 w + 8 half + 2 t (+ 1)): outlier
    channels take an fp16 pair of neighbouring tokens from ``vout_smem``."""
    lo_col, hi_col, C = self.lo_col, self.hi_col, self.C
    i32c = ptx.const_i32

    def patch(mt, k, half, r, vout_ref, row, quad):
      if not (8 * k < hi_col and 8 * k + 8 > lo_col):
        return None
      g = arith.andi(row, i32c(7))                     # row = 16 warp + g
      pred, o = ptx.in_range(arith.addi(g, i32c(8 * k)), lo_col, hi_col)
      t0 = j * SLOT
      col = arith.addi(arith.addi(i32c(t0 % C + 8 * half), arith.subi(row, g)), arith.muli(quad, i32c(2)))
      f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
      pair = mgpu_utils.bitcast(vector.load(f16x2, vout_ref, [ptx.to_index(o), ptx.as_index(t0 // C),
                                                              ptx.to_index(col)]),
                                ir.IntegerType.get_signless(32))
      return arith.select(pred, pair, r)
    return patch

  def key_scores(self, kc, tbase, codes_loaded=None):
    """Masked scores^T ``[64, npad]`` f32 of every slot: the tile's key code words read once
    (``codes_loaded()`` right after), each slot dequantized in registers and multiplied by
    the query, each warp its own rows."""
    wl = plgpu.Layout.WGMMA
    words = plgpu.load(kc, (), layout=wl)                                   # [64, dp] u16
    if codes_loaded is not None:
      codes_loaded()
    ss = []
    for j in range(self.cpw):
      if self.plan is not None and self.plan[j][0]:
        words = ptx.rotate_words(words, self.plan[j][0])     # in place: the old words are dead
      k16 = ptx.dequant(words, self.kmeta_smem, bits=self.bits, slot=j, meta_index=self.k_meta_index(j),
                        pos=None if self.plan is None else self.plan[j][1],
                        patch_ref=self.kout_smem if self.staged else None,
                        patch=self.key_patch(j) if self.staged else None)
      ss.append(ptx.warp_scores(k16, self.q_smem, npad=self.npad))
    rows = self.rows
    return [jnp.where(tbase + j * SLOT + rows < self.nq, s, NEG) for j, s in enumerate(ss)]

  def softmax_update(self, ss, m, l_rows):
    """One online-softmax update over a tile's scores, per warp (m ``[64, npad]``: each
    warp's rows hold its own maxima): returns (m, l_rows, the correction, p of each slot)."""
    s_max = functools.reduce(jnp.maximum, ss)
    m_new = jnp.maximum(m, ptx.warp_colmax(s_max))
    corr = jnp.exp2(m - m_new)
    l_rows = l_rows * corr
    ps = []
    for s in ss:
      ps.append(jnp.exp2(s - m_new))
      l_rows = l_rows + ps[-1]
    return m_new, l_rows, corr, ps

  def value_mma(self, vc, acc, ps, codes_loaded=None):
    """``acc [4 dp, npad] += v^T . p^T`` per warp over its own tokens; the value words are
    loaded as the key words and transposed in registers."""
    words = ptx.transpose_words(plgpu.load(vc, (), layout=plgpu.Layout.WGMMA))   # [64, dp] u16
    if codes_loaded is not None:
      codes_loaded()
    for j in range(self.cpw):
      if self.plan is not None and self.plan[j][0]:
        words = ptx.rotate_words(words, self.plan[j][0])
      v16 = ptx.dequant(words, self.vmeta_smem, bits=self.bits, slot=j, meta_index=self.v_meta_index(j),
                        meta_key=self.v_meta_key, pos=None if self.plan is None else self.plan[j][1],
                        patch_ref=self.vout_smem if self.staged else None,
                        patch=self.value_patch(j) if self.staged else None)
      acc = ptx.warp_pv(acc, v16, ps[j])
    return acc

  def tile(self, i, carry):
    """One tile: stage the key metadata, scores, stage the value metadata once the values
    have arrived, softmax, output MMAs; fetches the next tile's halves on the way."""
    kc, ks, kz, ko, vc, vs, vz, vo = self.tiles
    m, l_rows, acc = carry
    tbase = (self.tile0 + i) * self.P
    self.stage_meta(ks, kz, self.kmeta_smem, (ko, True) if self.staged else None)
    ss = self.key_scores(kc, tbase, (lambda: self.fetch_next(i, 0)) if self.early else None)
    if not self.early:
      self.fetch_next(i, 0)
    plgpu.barrier_wait(self.smem["v_bar"])
    self.stage_meta(vs, vz, self.vmeta_smem, (vo, False) if self.staged else None)
    m, l_rows, corr, ps = self.softmax_update(ss, m, l_rows)
    acc = self.value_mma(vc, ptx.warp_scale(acc, corr), ps,
                         (lambda: self.fetch_next(i, 1)) if self.early else None)
    return m, l_rows, acc

  # --- epilogue ---------------------------------------------------------------------------

  def store(self, m, l_rows, acc):
    """The four warps' partials, rescaled to their common maximum and summed, to HBM."""
    b, h, sp, smem = self.b, self.h, self.sp, self.smem
    m_all = m.max(axis=0)
    scale = jnp.exp2(m - lax.broadcast_in_dim(m_all, m.shape, [1]))
    smem["warp_out"][...] = ptx.warp_scale(acc, scale)
    smem["ml"][0] = m_all
    smem["ml"][1] = (l_rows * scale).sum(axis=0)
    plgpu.commit_smem()
    ptx.sum_warps(smem["warp_out"], smem["out"])
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem["out"], self.o_ref.at[b, h, sp])
    plgpu.copy_smem_to_gmem(smem["ml"].at[0], self.m_ref.at[b, h, sp])
    plgpu.copy_smem_to_gmem(smem["ml"].at[1], self.l_ref.at[b, h, sp])
    plgpu.wait_smem_to_gmem(0)

  def run(self):
    wl, f32, npad = plgpu.Layout.WGMMA, jnp.float32, self.npad
    self.prologue()
    self.rows = plgpu.broadcasted_iota(jnp.int32, (SLOT, npad), 0, layout=wl)
    init = (plgpu.layout_cast(jnp.full((SLOT, npad), NEG, f32), wl),            # per-warp maxima
            plgpu.layout_cast(jnp.zeros((SLOT, npad), f32), wl),
            plgpu.layout_cast(jnp.zeros((4 * self.dp, npad), f32), wl))  # row 64 mi + 16 w + r:
    # warp w's channel 16 mi + r

    def step(i, carry):
      plgpu.barrier_wait(self.smem["k_bar"])
      carry = self.tile(i, carry)
      if not self.early:
        self.fetch_next(i, 1)
      return carry
    self.store(*lax.fori_loop(0, self.bps, step, init))


def _choose_splits(n_tiles, batch_heads, config: MosaicGpuConfig):
  num_splits = config.num_splits
  if num_splits is None:
    num_splits = max(1, -(-config.target_programs // batch_heads))
  num_splits = max(1, min(int(num_splits), n_tiles))
  while n_tiles % num_splits:     # a divisor of n_tiles: every split stays inside the cache
    num_splits -= 1
  return num_splits, n_tiles // num_splits


def _partials(q_BNGA, kv: QuantizedKV, *, q_scale: float, config: MosaicGpuConfig):
  """The kernel's partials over the quantized region, heads minor, log2 units: m, l
  ``[B, N, NS, npad]``, o ``[B, N, NS, D_pad, npad]`` (channels in split order).

  q_BNGA: the raw queries (any float dtype); ``q_scale = sm_scale * log2(e)``."""
  lay = kv.layout
  f32 = jnp.float32
  b, h, g, d = q_BNGA.shape
  npad = 8 if g <= 8 else MAX_HEADS              # the MMAs' N: query heads, padded
  dp, n_out = lay.d_pad, lay.n_out
  tile = SLOT * lay.cpw
  ns, bps = _choose_splits(lay.cq // tile, b * h, config)
  kr = max(1, tile // lay.config.group_size)
  ng = lay.n_groups_tok
  idx_in = kv.k_outlier_idx.astype(jnp.int32) if n_out else np.zeros((b, h, 1), np.int32)
  ko, vo = kv.k_outliers, kv.v_outliers
  if not n_out:
    ko = vo = jnp.zeros((b, h, 1, lay.cq), jnp.bfloat16)
  c = ptx.chunk(tile)
  tm = lambda x: x.reshape(x.shape[:3] + (x.shape[3] // c, c))      # token-minor: [.., n, Cq/C, C]
  out_types = (
      jax.ShapeDtypeStruct((b, h, ns, dp, npad), f32),
      jax.ShapeDtypeStruct((b, h, ns, npad), f32),
      jax.ShapeDtypeStruct((b, h, ns, npad), f32),
  )
  args = (kv.lengths.astype(jnp.int32), q_BNGA, idx_in, kv.k_codes, kv.k_scale, kv.k_zero, tm(ko),
          kv.v_codes, tm(kv.v_scale), tm(kv.v_zero), tm(vo))
  smem, swizzle = plgpu.SMEM, ptx.transforms(dp, 2)
  staged = n_out > 0
  inplace = lay.config.group_size <= SLOT   # each key group in one slot (its scale: that slot's multiplier)
  scratch = {
      "q_raw": smem((g, d), q_BNGA.dtype),
      "q_op": smem((npad, dp), jnp.float16, transforms=swizzle),          # the score MMAs' B operand
      "k_meta": smem((2, kr, dp), jnp.float16),                           # key s2, z2 (staged)
      "v_meta": smem((2, ng, tile // c, c), jnp.float16),                 # value s2, z2
      "q_bar": plgpu.Barrier(num_barriers=1, num_arrivals=1),
  }
  if staged:     # fp16 outliers of a tile: keys [T, W] (their columns, from an even one), values
    k_lo, k_hi = lay.d_low - lay.d_low % 2, lay.d_low + n_out
    scratch["k_out"] = smem((tile, k_hi - k_lo + k_hi % 2), jnp.float16)
    scratch["v_out"] = smem((n_out, tile // c, c), jnp.float16)
  if inplace:    # per-element slot multipliers of the staged scales (keys, values)
    scratch["k_mult"] = smem((kr, dp), kv.k_scale.dtype)
    scratch["v_mult"] = smem((ng, tile // c, c), kv.v_scale.dtype)
  blocks = [((SLOT, dp), swizzle), ((kr, dp), ()), ((kr, dp), ()), ((ko.shape[2], tile // c, c), ()),
            ((SLOT, dp), swizzle), ((ng, tile // c, c), ()), ((ng, tile // c, c), ()),
            ((vo.shape[2], tile // c, c), ())]
  for name, (shape, tr), x in zip(_TILE_BUFFERS, blocks, args[3:]):
    scratch[name] = smem(shape, x.dtype, transforms=tr)
  scratch.update(k_bar=plgpu.Barrier(num_barriers=1, num_arrivals=4),
                 v_bar=plgpu.Barrier(num_barriers=1, num_arrivals=4),
                 out=smem((dp, npad), f32), ml=smem((2, npad), f32),
                 warp_out=smem((4 * dp, npad), f32))      # the warps' partials, combined at the end
  kern = plgpu.kernel(
      functools.partial(_kernel, names=tuple(scratch), lay=lay, bps=bps, npad=npad, staged=staged,
                        inplace=inplace, q_scale=q_scale),
      out_type=out_types, scratch_types=list(scratch.values()),
      compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=1024, unsafe_no_auto_barriers=False),
      grid=(b, h, ns), grid_names=("b", "h", "s"),
  )
  o, m, l = kern(*args)
  return m, l, o


@functools.partial(jax.jit, static_argnames=("sm_scale", "config"))
def _decode_attention_mosaic(q, kv: QuantizedKV, *, sm_scale: float, config: MosaicGpuConfig):
  b, h, a = q.shape
  q_BNGA = q.reshape(b, kv.num_heads, h // kv.num_heads, a)
  m, l, o = _partials(q_BNGA, kv, q_scale=sm_scale * LOG2E, config=config)
  # sinks, window, merge and channel order in one Triton kernel (as XLA ops: ~7 small kernels);
  # it scales the raw query and writes q.dtype itself
  return merge_heads_minor(q_BNGA, kv, m, l, o, q_scale=sm_scale * LOG2E, out_dtype=q.dtype,
                           config=config.merge, interpret=False).reshape(q.shape)


def decode_attention_mosaic(q: jax.Array, kv: QuantizedKV, *, sm_scale: float,
                            config: MosaicGpuConfig | None = None, interpret: bool = False) -> jax.Array:
  """``q [B, H, A]`` attended to ``kv`` -> ``[B, H, A]``; raises ``Unsupported`` for a layout
  or device this kernel does not take (see the module docstring)."""
  if interpret:
    raise Unsupported("the Mosaic GPU kernel has no interpret mode (it needs a Hopper GPU)")
  reason = unsupported_reason(kv.layout, q.shape[1] // kv.num_heads)
  if reason is not None:
    raise Unsupported(f"the Mosaic GPU kernel {reason}")
  if not impl_lib.is_hopper():
    raise Unsupported("the Mosaic GPU kernel needs a Hopper GPU (sm_90)")
  return _decode_attention_mosaic(q, kv, sm_scale=float(sm_scale), config=config or MosaicGpuConfig())
