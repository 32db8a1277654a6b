"""Decode attention (one query token per sequence) on a packed, quantized KV cache.

``decode_attention(q, kv)`` attends ``q [B, Hq, D]`` to a ``QuantizedKV`` (grouped
query heads: ``Hq`` a multiple of the cache's ``H``; per-sequence lengths) with a
split-K ("flash-decoding") Pallas kernel:

* grid ``(B, H, num_splits + 1)``. Program ``(b, h, s < num_splits)`` walks its
  share of the quantized region 32 tokens per loop step (half of a 64-token
  code *slot*): the ``[32, D_pad]`` uint16 code words of those tokens
  (``kv_quant`` layout) are dequantized to a ``[32, D_pad]`` fp16 tile in
  registers (inline PTX, two
  values per 32-bit register: see ``_dequant``), then ``scores = q_low . k^T``
  on the tensor cores (+ the 16-bit outlier channels), one online-softmax
  update (exp2; log2(e) is folded into the query), ``acc += p . v``. Slots past
  the sequence's quantized length are skipped. The last program
  ``(b, h, num_splits)`` attends to the full-precision sinks and window ring.
* Each program writes a partial (unnormalized output, running max, running
  sum); a small ``jnp`` step combines the ``num_splits + 1`` partials.
* Outlier channels cost no gather in the hot loop: the query is split outside
  it into ``q_low`` (the low-bit channels, in cache order) and ``q_out`` (the
  outlier channels); the value output is produced in the same split form and
  scattered back to channel order on the ``[B, Hq, D]`` result. Up to four
  outlier channels are rank-1 updates on the CUDA cores; more go through a
  padded tensor-core dot.

Nothing is dequantized to HBM. ``interpret=None`` compiles on GPU (Pallas'
Triton lowering, selected with ``pallas.triton.CompilerParams``) and interprets
on CPU, where the dequantization runs as the same arithmetic in ``jnp``
(``experiments/check_decode_gpu.py`` checks the PTX path on a GPU). The tiles
are 32-row multiples of 128-wide (for D = 128), so a TPU (Mosaic) path could
keep the same layout; none is written yet.

``decode_attention_bf16(q, k, v, lengths)`` is the same kernel shape on a plain
bf16 cache ``k, v [B, H, T, D]``.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import kv_quant as kq
from pallas_kernels.decode_merge import NEG, LOG2E, scaled_queries
from pallas_kernels.decode_merge import combine as _combine, pad_to as _pad_to
from pallas_kernels import _platform
from pallas_kernels._platform import resolve_interpret

_FMA_OUTLIERS = 4         # up to this many outlier channels: CUDA-core updates, not a dot
_TARGET_PROGRAMS = 1024    # ~8 per SM on an H200 (132 SMs)


def _np2(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


def _tile(ref, rows, cols, nrows, ncols, dtype=None):
  """Loads ref[rows, cols] (1-D index vectors), zero outside [0, nrows) x [0, ncols).

  A bound of ``None`` means the index is known to be in range (no mask).
  """
  r = rows[:, None]
  c = cols[None, :]
  mask = None
  if nrows is not None:
    mask = r < nrows
  if ncols is not None:
    mask = (c < ncols) if mask is None else mask & (c < ncols)
  if mask is None:
    x = pltriton.load(ref.at[r, c])
  else:
    x = pltriton.load(ref.at[r, c], mask=mask, other=jnp.zeros((), ref.dtype))
  return x if dtype is None else x.astype(dtype)


def _dot_t(a, b, dtype=jnp.bfloat16):
  """a [M, K] . b[N, K]^T -> f32 [M, N]; 16-bit operands, f32 accumulation."""
  return pltriton.dot(a.astype(dtype), b.astype(dtype), trans_b=True)


def _dot(a, b, dtype=jnp.bfloat16):
  return pltriton.dot(a.astype(dtype), b.astype(dtype))


def _softmax_update(carry, s):
  """Online softmax over one block of scores s [G, N] in log2 units (the query is
  pre-scaled by log2(e), so exp2, one MUFU op, replaces exp); returns (carry', p)."""
  m, l, accs = carry
  m_new = jnp.maximum(m, jnp.max(s, axis=1))
  corr = jnp.exp2(m - m_new)
  p = jnp.exp2(s - m_new[:, None])
  l = l * corr + jnp.sum(p, axis=1)
  accs = tuple(a * corr[:, None] for a in accs)
  return (m_new, l, accs), p


# --- dequantization in registers --------------------------------------------------------
#
# A code c of b bits (2, 3, 4 or 8) is turned into float16 by placing it in the
# top mantissa bits of 1.0: v = 1 + c * 2**-b (exact; fp16 has 10 mantissa bits),
# then x = v * s2 + z2 with s2 = s * 2**b and z2 = z - s2, both float16: one fma.
# Folding the "-1" into z2 costs the rounding of z - s2, which in bf16 (8-bit
# mantissa) was 1.7% relative error on attention outputs; in fp16 it is 8x smaller,
# so the dequantized tiles and the MMAs on them are float16 (low-bit channels must
# stay below 65504 in magnitude; outliers and the window stay bf16). On the GPU one
# 32-bit register holds the uint16 code words of two neighbouring channels, and
# three instructions make two fp16 values: a rotate that brings slot j's codes to
# the top mantissa bits of both halves, a lop3 that masks them and ORs in 1.0, and
# an f16x2 fma. (Per-element shifts, masks, int->float and f32->16-bit conversions
# were what held the first version of this kernel back.)

DEQ_DTYPE = jnp.float16


def _dequant_asm(bits):
  top = ((1 << bits) - 1) << (10 - bits)
  mask = top | (top << 16)
  return ("{ .reg .b32 t; shf.r.wrap.b32 t, $1, $1, $2; "
          f"lop3.b32 t, t, {mask:#010x}, 0x3c003c00, 0xea; "
          "fma.rn.f16x2 $0, t, $3, $4; }")


def _dequant_meta(s, z, bits):
  """float32 scale, zero -> the (s2, z2) fp16 operands of ``_dequant`` (done on the
  small metadata tile, before it is broadcast to the code tile)."""
  s2 = (s * float(1 << bits)).astype(DEQ_DTYPE)
  return s2, (z - s2.astype(jnp.float32)).astype(DEQ_DTYPE)


def _dequant(words, j, s2, z2, bits, use_asm):
  """Slot j (traced) of uint16 code words [N, C] -> fp16 [N, C] = s * code + z.

  s2, z2: from ``_dequant_meta``, already broadcast to [N, C].
  """
  shape = words.shape
  if use_asm:
    rot = jnp.mod(j * bits - (10 - bits), 32).astype(jnp.uint16)
    [out] = pltriton.elementwise_inline_asm(
        _dequant_asm(bits), args=[words, jnp.broadcast_to(rot, shape), s2, z2],
        constraints="=r,r,r,r,r", pack=2,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, DEQ_DTYPE)])
    return out
  # The same arithmetic in plain jnp (interpret mode, or any backend without PTX).
  c = (words.astype(jnp.uint32) >> (j * bits).astype(jnp.uint32)) & jnp.uint32((1 << bits) - 1)
  v = 1.0 + c.astype(jnp.float32) * (1.0 / (1 << bits))
  return (v * s2.astype(jnp.float32) + z2.astype(jnp.float32)).astype(DEQ_DTYPE)


# --- quantized kernel -------------------------------------------------------------------


def _quant_kernel(*refs, names, lay: kq.KVLayout, ns, bps, gp, dt, df, nop, use_asm, U, T,
                  rows_first=False):
  r = dict(zip(names, refs))
  cfg = lay.config
  bits, cpw, G = cfg.bits, lay.cpw, cfg.group_size
  W = kq.PACK_STRIDE                 # word rows per pack tile (= tokens per code slot)
  # T = tokens per unit of work: a whole slot (32) or half of one (16: fewer registers)
  S, R, cq, dp, n_out = cfg.sink_tokens, cfg.residual_window, lay.cq, lay.d_pad, lay.n_out
  sidx = pl.program_id(2)
  L = r["lengths"][0]
  nq = jnp.minimum(jnp.maximum(L - S - R, 0) // G * G, cq)
  arT = jnp.arange(T, dtype=jnp.int32)
  cols = jnp.arange(dt, dtype=jnp.int32)
  ocols = jnp.arange(nop, dtype=jnp.int32)
  colmask = None if dp == dt else dp            # code/scale columns past D_pad
  omask = None if nop == n_out else n_out

  def init():
    accs = (jnp.zeros((gp, dt), jnp.float32),) + ((jnp.zeros((gp, nop), jnp.float32),) if n_out else ())
    return (jnp.full((gp,), NEG, jnp.float32), jnp.zeros((gp,), jnp.float32), accs)

  def meta(name, axis, t0):
    """Dequantization operands (``_dequant_meta``) for the T tokens from quantized
    index t0, broadcast to [T, dt]."""
    sref, zref = r[f"{name}_scale"], r[f"{name}_zero"]
    if axis == "channel":
      n = max(1, T // G)                          # group rows in this slot
      rows = t0 // G + jnp.arange(n, dtype=jnp.int32)
      s, z = (_tile(ref, rows, cols, None, colmask, jnp.float32) for ref in (sref, zref))
      s, z = _dequant_meta(s, z, bits)
      if n == 1:
        return jnp.broadcast_to(s, (T, dt)), jnp.broadcast_to(z, (T, dt))
      return tuple(jnp.broadcast_to(x[:, None, :], (n, G, dt)).reshape(T, dt) for x in (s, z))
    ngp = dt // G
    gcols = jnp.arange(ngp, dtype=jnp.int32)
    gmask = None if ngp == lay.n_groups_tok else lay.n_groups_tok
    # stored token-minor [n_groups, Cq]: load [ngp, T], broadcast each group over its G channels
    s, z = (_tile(ref, gcols, t0 + arT, gmask, None, jnp.float32).T for ref in (sref, zref))
    s, z = _dequant_meta(s, z, bits)
    return tuple(jnp.broadcast_to(x[:, :, None], (T, ngp, G)).reshape(T, dt) for x in (s, z))

  def quant_part():
    q_lo = r["q_lo"][...]
    q_out = r["q_out"][...] if n_out else None
    fma_out = 0 < n_out <= _FMA_OUTLIERS
    if fma_out:
      q_cols = [jnp.sum(jnp.where(ocols[None, :] == c, q_out.astype(jnp.float32), 0.0), axis=1)
                for c in range(n_out)]
    slot0 = sidx * bps
    P, Ut = W * cpw, W * cpw // T                # tokens and units per word tile
    if rows_first:                               # whole tiles: every unit up to nq's tile
      nslot = jnp.clip((nq + P - 1) // P * Ut - slot0, 0, bps)
    else:
      nslot = jnp.clip((nq - slot0 * T + T - 1) // T, 0, bps)

    def locate(gs):
      """(t0, code slot j in its word tile, word rows) of unit gs: tokens [t0, t0 + T).

      Token order: units follow the tokens. rows_first: within a word tile, the cpw
      slots of one T-row band come one after another, so the band a program re-reads
      cpw times stays in L1 (T * D_pad * 2 bytes instead of the tile's W rows)."""
      gs = jnp.minimum(gs, cq // T - 1)          # a step's spare unit stays in bounds (masked)
      if rows_first:
        tile, u = jax.lax.div(gs, jnp.int32(Ut)), jax.lax.rem(gs, jnp.int32(Ut))
        band, j = jax.lax.div(u, jnp.int32(cpw)), jax.lax.rem(u, jnp.int32(cpw))
        return tile * P + j * W + band * T, j, tile * W + band * T + arT
      t0 = gs * T
      slot = t0 // W
      return (t0, jax.lax.rem(slot, jnp.int32(cpw)),
              jax.lax.div(slot, jnp.int32(cpw)) * W + (t0 % W) + arT)

    def scores(gs, valid):
      t0, j, wrows = locate(gs)
      ks, kz = meta("k", cfg.key_axis, t0)
      kw = _tile(r["k_codes"], wrows, cols, None, colmask)
      s = _dot_t(q_lo, _dequant(kw, j, ks, kz, bits, use_asm), DEQ_DTYPE)
      if fma_out:
        # few outlier channels: rank-1 updates on the CUDA cores beat a padded dot
        for c in range(n_out):
          ko = pltriton.load(r["k_outliers"].at[c, t0 + arT]).astype(jnp.float32)
          s = s + q_cols[c][:, None] * ko[None, :]
      elif n_out:
        ko_t = _tile(r["k_outliers"], ocols, t0 + arT, omask, None)     # [nop, T]
        s = s + _dot(q_out, ko_t)
      if G < T or rows_first:                    # nq is a multiple of G only; rows_first
        valid = valid & (t0 + arT < nq)          # reaches past nq inside the last tile
      elif valid is not True:
        valid = jnp.broadcast_to(valid, (T,))
      return s if valid is True else jnp.where(valid[None, :], s, NEG)

    def values(gs, p, accs):
      t0, j, wrows = locate(gs)
      vs, vz = meta("v", cfg.value_axis, t0)
      vw = _tile(r["v_codes"], wrows, cols, None, colmask)
      new = [accs[0] + _dot(p, _dequant(vw, j, vs, vz, bits, use_asm), DEQ_DTYPE)]
      if fma_out:
        upd = accs[1]
        for c in range(n_out):
          vo = pltriton.load(r["v_outliers"].at[c, t0 + arT]).astype(jnp.float32)
          upd = upd + jnp.where(ocols[None, :] == c, jnp.sum(p * vo[None, :], axis=1)[:, None], 0.0)
        new.append(upd)
      elif n_out:
        vo_t = _tile(r["v_outliers"], ocols, t0 + arT, omask, None)     # [nop, T]
        new.append(accs[1] + _dot_t(p, vo_t))
      return new

    def body(i, carry):
      # U slots per step: one softmax rescale per U * T tokens.
      gs0 = slot0 + i * U
      ss = [scores(gs0 + u, True if u == 0 else (i * U + u < nslot)) for u in range(U)]
      m, l, accs = carry
      m_new = functools.reduce(jnp.maximum, [jnp.max(x, axis=1) for x in ss], m)
      corr = jnp.exp2(m - m_new)
      l = l * corr
      accs = [a * corr[:, None] for a in accs]
      for u in range(U):
        p = jnp.exp2(ss[u] - m_new[:, None])
        l = l + jnp.sum(p, axis=1)
        accs = values(gs0 + u, p, accs)
      return (m_new, l, tuple(accs))

    return jax.lax.fori_loop(0, pl.cdiv(nslot, U), body, init())

  def fp_part():
    # Sinks and window ring, in channel order (no gathers: they cost registers that
    # the whole kernel then pays); the wrapper splits the output into low/outlier form.
    F, wc = lay.fp_slots, lay.ring
    q_fp = r["q_fp"][...]
    dcols = jnp.arange(df, dtype=jnp.int32)
    ar16 = jnp.arange(16, dtype=jnp.int32)

    def body(i, carry):
      slot = i * 16 + ar16
      m_ = L - S
      last = m_ - 1
      p_ring = S + last - jnp.mod(last - (slot - S), wc)
      valid = jnp.where(slot < S, slot < L, (m_ > 0) & (p_ring >= S + nq) & (p_ring < L))
      valid = valid & (slot < F)
      k = _tile(r["k_fp"], slot, dcols, F, lay.head_dim)
      s = jnp.where(valid[None, :], _dot_t(q_fp, k), NEG)
      carry, p = _softmax_update(carry, s)
      m, l, (acc,) = carry
      v = _tile(r["v_fp"], slot, dcols, F, lay.head_dim)
      return (m, l, (acc + _dot(p, v),))

    init = (jnp.full((gp,), NEG, jnp.float32), jnp.zeros((gp,), jnp.float32),
            (jnp.zeros((gp, df), jnp.float32),))
    return jax.lax.fori_loop(0, pl.cdiv(F, 16), body, init)

  def run_quant():
    m, l, accs = quant_part()
    r["o_lo"][...] = accs[0]
    if n_out:
      r["o_out"][...] = accs[1]
    r["m"][...] = m
    r["l"][...] = l

  def run_fp():
    m, l, (acc,) = fp_part()
    r["o_fp"][...] = acc
    r["m"][...] = m
    r["l"][...] = l

  if ns == 0:
    run_fp()
  else:
    jax.lax.cond(sidx < ns, run_quant, run_fp)


def _choose_splits(num_blocks, batch_heads, num_splits):
  if num_blocks == 0:
    return 0, 1
  if num_splits is None:
    num_splits = max(1, -(-_TARGET_PROGRAMS // batch_heads))
  num_splits = max(1, min(int(num_splits), num_blocks))
  bps = -(-num_blocks // num_splits)
  return -(-num_blocks // bps), bps



@functools.partial(jax.jit, static_argnames=("sm_scale", "num_splits", "num_warps", "num_stages",
                                             "slots_per_step", "step_tokens", "interpret", "rows_first"))
def _decode_quant(q, kv, *, sm_scale, num_splits, num_warps, num_stages, slots_per_step,
                  step_tokens, interpret, rows_first=False):
  lay = kv.layout
  cfg = lay.config
  b, hq, d = q.shape
  h = kv.num_heads
  g = hq // h
  gp = max(16, _np2(g))
  n_out = lay.n_out
  dt = max(16, _np2(lay.d_low), cfg.group_size)
  df = max(16, _np2(d))
  nop = max(16, _np2(n_out))
  if rows_first:                 # splits hold whole word tiles (units are reordered inside one)
    units_per_tile = lay.pack_tokens // step_tokens
    ns, tiles_per_split = _choose_splits(lay.cq // lay.pack_tokens, b * h, num_splits)
    bps = tiles_per_split * units_per_tile
  else:
    ns, bps = _choose_splits(lay.cq // step_tokens, b * h, num_splits)

  qg = scaled_queries(q, h, sm_scale)
  k_lo_idx = kq.low_channel_index(kv.k_outlier_idx, d)
  q_lo = jnp.take_along_axis(qg, k_lo_idx[:, :, None, :], axis=3)
  inputs = {
      "lengths": kv.lengths.astype(jnp.int32),
      "q_lo": _pad_to(q_lo, (b, h, gp, dt)).astype(DEQ_DTYPE),
      "q_fp": _pad_to(qg, (b, h, gp, df)).astype(jnp.bfloat16),
      "k_fp": kv.k_fp, "v_fp": kv.v_fp,
  }
  if n_out:
    q_out = jnp.take_along_axis(qg, kv.k_outlier_idx[:, :, None, :], axis=3)
    inputs["q_out"] = _pad_to(q_out, (b, h, gp, nop)).astype(jnp.bfloat16)
  if ns:
    for name in ("k", "v"):
      for f in ("codes", "scale", "zero"):
        inputs[f"{name}_{f}"] = getattr(kv, f"{name}_{f}")
      if n_out:
        inputs[f"{name}_outliers"] = getattr(kv, f"{name}_outliers")

  def spec(x):
    if x.ndim == 1:
      return pl.BlockSpec((1,), lambda bi, hi, si: (bi,))
    rest = x.shape[2:]
    return pl.BlockSpec((None, None) + rest, lambda bi, hi, si, n=len(rest): (bi, hi) + (0,) * n)

  names = list(inputs)
  nsp = ns + 1
  out_shapes = {
      "o_lo": jax.ShapeDtypeStruct((b, h, nsp, gp, dt), jnp.float32),
      "m": jax.ShapeDtypeStruct((b, h, nsp, gp), jnp.float32),
      "l": jax.ShapeDtypeStruct((b, h, nsp, gp), jnp.float32),
  }
  if n_out:
    out_shapes["o_out"] = jax.ShapeDtypeStruct((b, h, nsp, gp, nop), jnp.float32)
  out_shapes["o_fp"] = jax.ShapeDtypeStruct((b, h, gp, df), jnp.float32)   # last split only
  out_names = list(out_shapes)

  def ospec(name):
    if name == "o_fp":
      return pl.BlockSpec((None, None, gp, df), lambda bi, hi, si: (bi, hi, 0, 0))
    rest = out_shapes[name].shape[3:]
    return pl.BlockSpec((None, None, None) + rest, lambda bi, hi, si, n=len(rest): (bi, hi, si) + (0,) * n)

  kernel = functools.partial(
      _quant_kernel, names=names + out_names, lay=lay, ns=ns, bps=bps, gp=gp, dt=dt, df=df,
      nop=nop, use_asm=not interpret, U=slots_per_step, T=step_tokens, rows_first=rows_first)
  outs = pl.pallas_call(
      kernel,
      grid=(b, h, nsp),
      in_specs=[spec(inputs[n]) for n in names],
      out_specs=[ospec(n) for n in out_names],
      out_shape=[out_shapes[n] for n in out_names],
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="decode_attention_quantized",
  )(*[inputs[n] for n in names])
  outs = dict(zip(out_names, outs))
  # Splits 0..ns-1 hold the quantized region in split form, put back in channel order by a
  # gather (no scatter: on small calls one costs more than the kernel); the last split's
  # partial is o_fp (sinks and window, already in channel order).
  pos = kq.channel_positions(kv.v_outlier_idx, d)[:, :, None, None, :]
  o_out = outs["o_out"][:, :, :ns] if n_out else None
  o_q = kq.from_split(outs["o_lo"][:, :, :ns], o_out, pos, n_out)
  parts = jnp.concatenate([o_q, outs["o_fp"][:, :, None, :, :d]], axis=2)      # [B,H,ns+1,gp,D]
  (o,) = _combine(outs["m"], outs["l"], [parts])
  o = o[:, :, :g]
  return o.reshape(b, hq, d).astype(q.dtype)


# "auto" takes the Mosaic GPU kernel on Hopper wherever it supports the layout. Sessions 5-8
# kept small caches (< 32k per sequence and < 64k tokens) on Triton, whose per-program cost
# was lower; once the Mosaic path's merge became one kernel (session 9) it wins at every size
# timed. H200, 2026-12-04 (docs/benchmarks.md, session 10; 2-bit + 2 %), triton / mosaic ms:
# B=1 4k 0.060 / 0.033; B=8 4k 0.058 / 0.044; B=1 32k 0.071 / 0.037; B=8 32k 0.353 / 0.136.
# Session 11's five bench runs agree (small calls vary run to run; Mosaic never slower at 4k).


def choose_backend(backend: str, kv: kq.QuantizedKV, num_q_heads_per_kv: int, interpret: bool) -> str:
  """Resolves ``backend`` ("auto", "triton", "mosaic" or "tpu") to the kernel that runs."""
  if backend not in ("auto", "triton", "mosaic", "tpu"):
    raise ValueError(f"backend must be 'auto', 'triton', 'mosaic' or 'tpu', got {backend!r}")
  if backend == "auto" and not interpret and _platform.backend() == "tpu":
    backend = "tpu"
  if backend == "tpu":
    from pallas_kernels import decode_attention_tpu as tpu
    tpu.check_supported(kv.layout)
    return backend
  if backend == "triton":
    return backend
  from pallas_kernels import decode_attention_mgpu as mgpu
  supported = mgpu.supports(kv.layout, num_q_heads_per_kv)
  if backend == "mosaic":
    if not supported:
      raise ValueError(f"the Mosaic GPU decode kernel does not support this cache layout "
                       f"({kv.layout.config}, D_pad={kv.layout.d_pad}); use backend='triton'")
    if interpret:
      raise ValueError("backend='mosaic' has no interpret mode (it needs a Hopper GPU); "
                       "use backend='triton' or 'auto'")
    return backend
  return "mosaic" if supported and not interpret and mgpu.is_hopper() else "triton"


def decode_attention(q: jax.Array, kv: kq.QuantizedKV, *, sm_scale: float | None = None,
                     num_splits: int | None = None, num_warps: int = 1, num_stages: int = 1,
                     slots_per_step: int = 1, step_tokens: int = 32, rows_first: bool = False,
                     backend: str = "auto", interpret: bool | None = None) -> jax.Array:
  """Attention of one query token per sequence to a quantized KV cache.

  Args:
    q: ``[B, Hq, D]`` (any float dtype; the output has the same dtype). Query head
      ``i`` uses kv-head ``i // (Hq // H)``.
    kv: ``QuantizedKV`` with batch ``B``, ``H`` kv-heads, head dim ``D``; its
      ``lengths`` say how many positions each sequence attends to.
    sm_scale: softmax scale, default ``1 / sqrt(D)``.
    num_splits: programs per (sequence, kv-head) over the quantized region
      (default: enough to put ~1024 programs on the device).
    num_warps, num_stages: Triton launch settings. 1 warp, 1 stage, 15 splits was
      the fastest of 26 variants on an H200 at B=8, 32k (0.354 ms; 2 warps 0.484,
      4 warps 0.881; experiments/bench_decode_attention.py --variants).
    step_tokens: tokens per unit of work, 32 (half a 64-token code slot) or 16
      (smaller register tiles).
    slots_per_step: units per loop step (1, 2 or 4): one softmax rescale per step.
    rows_first: Triton only. Within each ``[64, D_pad]`` word tile, take the slots of
      one band of ``step_tokens`` word rows one after another (the band is re-read once
      per slot, and stays in L1), instead of token order (each slot re-reads both
      halves of the tile). Not yet timed on a GPU: off by default.
    backend: "auto" (default): "mosaic" when compiling for a Hopper GPU (sm_90),
      ``decode_attention_mgpu.supports`` accepts the layout (it is faster there at
      every size timed, 4k-128k tokens per sequence, B = 1 and 8); else "triton".
      "triton": this module's kernel (every layout, any CUDA GPU, interpret mode).
      "mosaic": ``decode_attention_mgpu`` (Hopper only; num_warps, num_stages,
      slots_per_step and step_tokens do not apply). On an H200 with 2-bit + 2 %
      outliers at B=8, 32k: mosaic 0.094 ms, triton 0.354 ms, bf16 XLA 0.314 ms
      (docs/benchmarks.md, 2026-12-06, session 19).
      "tpu": ``decode_attention_tpu`` (block-spec Pallas TPU kernel; "auto" takes it
      on a TPU; with ``interpret=True`` it runs in Pallas' TPU interpret mode).
    interpret: ``None`` = compiled on GPU (dequantization in inline PTX),
      interpreted on CPU (the same arithmetic in ``jnp``).
  Returns:
    ``[B, Hq, D]``; zeros for a sequence of length 0.
  """
  if q.ndim != 3:
    raise ValueError(f"q must be [B, Hq, D], got shape {q.shape}")
  b, hq, d = q.shape
  if (b, d) != (kv.batch, kv.layout.head_dim):
    raise ValueError(f"q [B, Hq, D] = {q.shape} does not match the cache "
                     f"(B={kv.batch}, D={kv.layout.head_dim})")
  if hq % kv.num_heads:
    raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({kv.num_heads})")
  if slots_per_step not in (1, 2, 4):
    raise ValueError(f"slots_per_step must be 1, 2 or 4, got {slots_per_step!r}")
  if step_tokens not in (16, 32):
    raise ValueError(f"step_tokens must be 16 or 32, got {step_tokens!r}")
  sm_scale = float(1.0 / math.sqrt(d) if sm_scale is None else sm_scale)
  interpret = resolve_interpret(interpret)
  chosen = choose_backend(backend, kv, hq // kv.num_heads, interpret)
  if chosen == "mosaic":
    from pallas_kernels import decode_attention_mgpu as mgpu
    return mgpu.decode_attention_mgpu(q, kv, sm_scale=sm_scale, num_splits=num_splits)
  if chosen == "tpu":
    from pallas_kernels import decode_attention_tpu as tpu
    return tpu.decode_attention_tpu(q, kv, sm_scale=sm_scale, interpret=interpret)
  return _decode_quant(q, kv, sm_scale=sm_scale, num_splits=num_splits, num_warps=num_warps,
                       num_stages=num_stages, slots_per_step=slots_per_step, step_tokens=step_tokens,
                       interpret=interpret, rows_first=rows_first)


# --- bf16 kernel ------------------------------------------------------------------------


def _bf16_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, t, bk, bps, gp, df, d):
  sidx = pl.program_id(2)
  L = jnp.minimum(len_ref[0], t)
  q = q_ref[...]
  start = sidx * bps * bk
  nblk = jnp.clip((L - start + bk - 1) // bk, 0, bps)
  rows0 = jnp.arange(bk, dtype=jnp.int32)
  cols = jnp.arange(df, dtype=jnp.int32)

  def body(i, carry):
    rows = start + i * bk + rows0
    k = _tile(k_ref, rows, cols, t, d)
    s = jnp.where((rows < L)[None, :], _dot_t(q, k), NEG)
    carry, p = _softmax_update(carry, s)
    m, l, (acc,) = carry
    v = _tile(v_ref, rows, cols, t, d)
    return (m, l, (acc + _dot(p, v),))

  init = (jnp.full((gp,), NEG, jnp.float32), jnp.zeros((gp,), jnp.float32),
          (jnp.zeros((gp, df), jnp.float32),))
  m, l, (acc,) = jax.lax.fori_loop(0, nblk, body, init)
  o_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_k", "num_splits", "num_warps",
                                             "num_stages", "interpret"))
def _decode_bf16(q, k, v, lengths, *, sm_scale, block_k, num_splits, num_warps, num_stages,
                 interpret):
  b, hq, d = q.shape
  _, h, t, _ = k.shape
  g = hq // h
  gp = max(16, _np2(g))
  df = max(16, _np2(d))
  num_blocks = -(-t // block_k)
  ns, bps = _choose_splits(num_blocks, b * h, num_splits)
  qg = scaled_queries(q, h, sm_scale)
  qp = _pad_to(qg, (b, h, gp, df)).astype(jnp.bfloat16)
  kernel = functools.partial(_bf16_kernel, t=t, bk=block_k, bps=bps, gp=gp, df=df, d=d)
  full = lambda x: pl.BlockSpec((None, None) + x.shape[2:], lambda bi, hi, si: (bi, hi, 0, 0))
  o, m, l = pl.pallas_call(
      kernel,
      grid=(b, h, ns),
      in_specs=[pl.BlockSpec((1,), lambda bi, hi, si: (bi,)), full(qp), full(k), full(v)],
      out_specs=[pl.BlockSpec((None, None, None, gp, df), lambda bi, hi, si: (bi, hi, si, 0, 0)),
                 pl.BlockSpec((None, None, None, gp), lambda bi, hi, si: (bi, hi, si, 0)),
                 pl.BlockSpec((None, None, None, gp), lambda bi, hi, si: (bi, hi, si, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, h, ns, gp, df), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, ns, gp), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, ns, gp), jnp.float32)],
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="decode_attention_bf16",
  )(lengths.astype(jnp.int32), qp, k, v)
  (o,) = _combine(m, l, [o])
  return o[:, :, :g, :d].reshape(b, hq, d).astype(q.dtype)


def decode_attention_bf16(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
                          sm_scale: float | None = None, block_k: int = 64,
                          num_splits: int | None = None, num_warps: int = 4, num_stages: int = 2,
                          interpret: bool | None = None) -> jax.Array:
  """Same kernel shape as ``decode_attention`` on an unquantized cache.

  q: ``[B, Hq, D]``; k, v: ``[B, H, T, D]`` (bf16 or f16; read as is);
  lengths: ``int[B]`` valid positions per sequence. Returns ``[B, Hq, D]``.
  On a TPU (compiled) this is XLA's attention (``reference.decode_attention_bf16``):
  the kernel is a Triton one, and on an unquantized cache XLA already streams K and V.
  """
  if q.ndim != 3 or k.ndim != 4 or k.shape != v.shape:
    raise ValueError(f"need q [B, Hq, D] and k, v [B, H, T, D]; got {q.shape}, {k.shape}, {v.shape}")
  b, hq, d = q.shape
  if k.shape[0] != b or k.shape[3] != d:
    raise ValueError(f"q {q.shape} does not match k {k.shape}")
  if hq % k.shape[1]:
    raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({k.shape[1]})")
  lengths = jnp.asarray(lengths)
  if lengths.shape != (b,):
    raise ValueError(f"lengths must be [B] = [{b}], got {lengths.shape}")
  if block_k < 16 or block_k & (block_k - 1):
    raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
  sm_scale = float(1.0 / math.sqrt(d) if sm_scale is None else sm_scale)
  interpret = resolve_interpret(interpret)
  if _platform.backend() == "tpu" and not interpret:
    from pallas_kernels import reference
    return reference.decode_attention_bf16(q, k, v, lengths, sm_scale=sm_scale).astype(q.dtype)
  return _decode_bf16(q, k, v, lengths, sm_scale=sm_scale, block_k=block_k, num_splits=num_splits,
                      num_warps=num_warps, num_stages=num_stages, interpret=interpret)
