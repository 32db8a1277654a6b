"""Decode attention (one query token per sequence) on a packed, quantized KV cache.

``decode_attention(q, kv)`` attends ``q [B, Hq, D]`` to a ``QuantizedKV`` (grouped
query heads: ``Hq`` a multiple of the cache's ``H``; per-sequence lengths) with a
split-K ("flash-decoding") Pallas kernel:

* grid ``(B, H, num_splits + 1)``. Program ``(b, h, s < num_splits)`` walks its
  share of the quantized region one *pack tile* at a time: a ``[16, D_pad]``
  tile of uint32 words per K and V, i.e. ``16 * codes_per_word`` tokens. Slot ``j``
  of the tile is a ``[16 tokens, D_pad]`` tile of codes (one shift and mask), which
  is dequantized in registers (``code * scale + zero``, scales from the tile's
  group) and fed to the tensor cores: ``scores = q_low . k^T`` (+ ``q_out . k_out^T``
  for the 16-bit outlier channels), one online-softmax update per pack tile,
  ``acc += p . v``. Blocks past the sequence's quantized length are skipped.
  The last program ``(b, h, num_splits)`` attends to the full-precision sinks and
  window ring.
* Each program writes a partial (unnormalized output, running max, running
  sum); a small ``jnp`` step combines the ``num_splits + 1`` partials.
* Outlier channels cost no gather in the kernel's hot loop: the query is split
  outside it into ``q_low`` (the low-bit channels, in cache order) and ``q_out``
  (the outlier channels); the value output is produced in the same split form
  and scattered back to channel order on the ``[B, Hq, D]`` result.

Nothing is dequantized to HBM. ``interpret=None`` compiles on GPU (Pallas'
Triton lowering, selected with ``pallas.triton.CompilerParams``) and interprets
on CPU. The tiles are 16-row multiples of 128-wide (for D = 128) with int32/uint32
shifts, so a TPU (Mosaic) path could keep the same layout; none is written yet.

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
from pallas_kernels._platform import resolve_interpret

NEG = -1e30
_TARGET_PROGRAMS = 512     # ~4 per SM on an H200 (132 SMs)


def _np2(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


def _tile(ref, rows, cols, nrows, ncols, dtype=None):
  """Loads ref[rows, cols] (1-D index vectors), zero outside [0, nrows) x [0, ncols)."""
  r = rows[:, None]
  c = cols[None, :]
  x = pltriton.load(ref.at[r, c], mask=(r < nrows) & (c < ncols), other=jnp.zeros((), ref.dtype))
  return x if dtype is None else x.astype(dtype)


def _dot_t(a, b, operands="bf16"):
  """a [M, K] . b[N, K]^T -> f32 [M, N], f32 accumulation.

  operands="bf16" rounds both to bf16; "tf32" feeds float32 registers to the
  tensor cores as tf32 (no conversion instructions; 10-bit mantissa).
  """
  dt = jnp.bfloat16 if operands == "bf16" else jnp.float32
  return pltriton.dot(a.astype(dt), b.astype(dt), trans_b=True)


def _dot(a, b, operands="bf16"):
  dt = jnp.bfloat16 if operands == "bf16" else jnp.float32
  return pltriton.dot(a.astype(dt), b.astype(dt))


def _codes(w, j, bits, dequant):
  """Slot j of uint32 words w, as float32.

  dequant="convert": the code c itself (shift, mask, int->float conversion).
  dequant="magic": 1 + c * 2**-bits, built by moving the code into the top
  mantissa bits of 1.0f (shift, and/or; no conversion instruction, which runs
  at a quarter of the integer rate on recent GPUs). The caller folds the
  affine map into the scale and zero (see ``_magic_meta``).
  """
  m = (1 << bits) - 1
  if dequant == "convert":
    return ((w >> jnp.uint32(j * bits)) & jnp.uint32(m)).astype(jnp.float32)
  sh = (23 - bits) - j * bits
  t = (w << jnp.uint32(sh)) if sh >= 0 else (w >> jnp.uint32(-sh))
  t = (t & jnp.uint32(m << (23 - bits))) | jnp.uint32(0x3F800000)
  return jax.lax.bitcast_convert_type(t, jnp.float32)


def _codes_dyn(w, j, bits, dequant):
  """``_codes`` for a traced slot index j."""
  m = (1 << bits) - 1
  w = w >> (j * bits).astype(jnp.uint32)
  if dequant == "convert":
    return (w & jnp.uint32(m)).astype(jnp.float32)
  t = ((w << jnp.uint32(23 - bits)) & jnp.uint32(m << (23 - bits))) | jnp.uint32(0x3F800000)
  return jax.lax.bitcast_convert_type(t, jnp.float32)


def _magic_meta(s, z, bits, dequant):
  """(scale, zero) such that value = _codes(...) * scale + zero."""
  if dequant == "convert":
    return s, z
  s2 = s * float(1 << bits)
  return s2, z - s2


def _softmax_update(carry, s):
  """Online softmax over one block of scores s [G, N]; returns (carry', p)."""
  m, l, accs = carry
  m_new = jnp.maximum(m, jnp.max(s, axis=1))
  corr = jnp.exp(m - m_new)
  p = jnp.exp(s - m_new[:, None])
  l = l * corr + jnp.sum(p, axis=1)
  accs = tuple(a * corr[:, None] for a in accs)
  return (m_new, l, accs), p


# --- quantized kernel -------------------------------------------------------------------


def _quant_kernel(*refs, names, lay: kq.KVLayout, ns, bps, gp, dt, df, nop, num_groups_tok,
                  dequant, operands, loop):
  r = dict(zip(names, refs))
  cfg = lay.config
  bits, cpw, P, G = cfg.bits, lay.cpw, lay.pack_tokens, cfg.group_size
  S, R, cq, dp, dl, n_out = cfg.sink_tokens, cfg.residual_window, lay.cq, lay.d_pad, lay.d_low, lay.n_out
  sidx = pl.program_id(2)
  L = r["lengths"][0]
  nq = jnp.minimum(jnp.maximum(L - S - R, 0) // G * G, cq)
  ar16 = jnp.arange(16, dtype=jnp.int32)
  cols = jnp.arange(dt, dtype=jnp.int32)
  ocols = jnp.arange(nop, dtype=jnp.int32)

  def init():
    accs = (jnp.zeros((gp, dt), jnp.float32),) + ((jnp.zeros((gp, nop), jnp.float32),) if n_out else ())
    return (jnp.full((gp,), NEG, jnp.float32), jnp.zeros((gp,), jnp.float32), accs)

  def meta(name, axis, t0):
    """Scale and zero for the 16 tokens starting at quantized index t0: [1|16, dt] f32."""
    if axis == "channel":
      row = jnp.full((1,), t0 // G, jnp.int32)
      s = _tile(r[f"{name}_scale"], row, cols, cq // G, dp, jnp.float32)
      z = _tile(r[f"{name}_zero"], row, cols, cq // G, dp, jnp.float32)
      return _magic_meta(s, z, bits, dequant)
    ngp = dt // G
    gcols = jnp.arange(ngp, dtype=jnp.int32)
    rows = t0 + ar16
    s = _tile(r[f"{name}_scale"], rows, gcols, cq, num_groups_tok, jnp.float32)
    z = _tile(r[f"{name}_zero"], rows, gcols, cq, num_groups_tok, jnp.float32)
    s, z = _magic_meta(s, z, bits, dequant)
    s = jnp.broadcast_to(s[:, :, None], (16, ngp, G)).reshape(16, dt)
    z = jnp.broadcast_to(z[:, :, None], (16, ngp, G)).reshape(16, dt)
    return s, z

  def quant_part():
    q_lo = r["q_lo"][...]
    q_out = r["q_out"][...] if n_out else None
    blk0 = sidx * bps
    nblk = jnp.clip((nq - blk0 * P + P - 1) // P, 0, bps)

    def body(i, carry):
      blk = blk0 + i
      wrows = blk * 16 + ar16
      kw = _tile(r["k_codes"], wrows, cols, cq // cpw, dp)
      vw = _tile(r["v_codes"], wrows, cols, cq // cpw, dp)
      scores = []
      for j in range(cpw):
        t0 = blk * P + j * 16
        kc = _codes(kw, j, bits, dequant)
        ks, kz = meta("k", cfg.key_axis, t0)
        s = _dot_t(q_lo, kc * ks + kz, operands)
        if n_out:
          ko = _tile(r["k_outliers"], t0 + ar16, ocols, cq, n_out)
          s = s + _dot_t(q_out, ko, operands)
        scores.append(jnp.where(t0 < nq, s, NEG))
      m, l, accs = carry
      m_blk = functools.reduce(jnp.maximum, [jnp.max(s, axis=1) for s in scores])
      m_new = jnp.maximum(m, m_blk)
      corr = jnp.exp(m - m_new)
      l = l * corr
      accs = [a * corr[:, None] for a in accs]
      for j in range(cpw):
        t0 = blk * P + j * 16
        p = jnp.exp(scores[j] - m_new[:, None])
        l = l + jnp.sum(p, axis=1)
        vc = _codes(vw, j, bits, dequant)
        vs, vz = meta("v", cfg.value_axis, t0)
        accs[0] = accs[0] + _dot(p, vc * vs + vz, operands)
        if n_out:
          vo = _tile(r["v_outliers"], t0 + ar16, ocols, cq, n_out)
          accs[1] = accs[1] + _dot(p, vo, operands)
      return (m_new, l, tuple(accs))

    def slot_body(i, carry):
      # One 16-token slot per iteration: slot j of pack tile blk.
      m, l, accs, kw, vw = carry
      blk = blk0 + jax.lax.div(i, jnp.int32(cpw))      # i >= 0: truncation is floor
      j = jax.lax.rem(i, jnp.int32(cpw))
      t0 = blk * P + j * 16
      wrows = blk * 16 + ar16
      if loop == "slots":
        kw = _tile(r["k_codes"], wrows, cols, cq // cpw, dp)
        vw = _tile(r["v_codes"], wrows, cols, cq // cpw, dp)
      else:   # "slots_carry": reload the word tiles only at slot 0
        kw, vw = jax.lax.cond(
            j == 0,
            lambda: (_tile(r["k_codes"], wrows, cols, cq // cpw, dp),
                     _tile(r["v_codes"], wrows, cols, cq // cpw, dp)),
            lambda: (kw, vw))
      ks, kz = meta("k", cfg.key_axis, t0)
      s = _dot_t(q_lo, _codes_dyn(kw, j, bits, dequant) * ks + kz, operands)
      if n_out:
        ko = _tile(r["k_outliers"], t0 + ar16, ocols, cq, n_out)
        s = s + _dot_t(q_out, ko, operands)
      (m, l, accs), p = _softmax_update((m, l, accs), s)
      vs, vz = meta("v", cfg.value_axis, t0)
      new = [accs[0] + _dot(p, _codes_dyn(vw, j, bits, dequant) * vs + vz, operands)]
      if n_out:
        vo = _tile(r["v_outliers"], t0 + ar16, ocols, cq, n_out)
        new.append(accs[1] + _dot(p, vo, operands))
      return (m, l, tuple(new), kw, vw)

    if loop == "unrolled":
      return jax.lax.fori_loop(0, nblk, body, init())
    # slots of this split holding quantized tokens (nq is a multiple of 16)
    nslot = jnp.clip((nq - blk0 * P) // 16, 0, bps * cpw)
    zw = jnp.zeros((16, dt), jnp.uint32)
    m, l, accs, _, _ = jax.lax.fori_loop(0, nslot, slot_body, init() + (zw, zw))
    return m, l, accs

  def fp_part():
    F, wc = lay.fp_slots, lay.ring
    q_fp = r["q_fp"][...]
    dcols = jnp.arange(df, dtype=jnp.int32)
    vlo = r["v_lo_idx"][...]
    vout = r["v_out_idx"][...] if n_out else None

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
      m, l, accs = carry
      rr = slot[:, None]
      ok = (rr < F)
      v_lo = pltriton.load(r["v_fp"].at[rr, vlo[None, :]], mask=ok & (cols[None, :] < dl),
                            other=jnp.zeros((), r["v_fp"].dtype))
      new = [accs[0] + _dot(p, v_lo)]
      if n_out:
        v_o = pltriton.load(r["v_fp"].at[rr, vout[None, :]], mask=ok & (ocols[None, :] < n_out),
                             other=jnp.zeros((), r["v_fp"].dtype))
        new.append(accs[1] + _dot(p, v_o))
      return (m, l, tuple(new))

    return jax.lax.fori_loop(0, pl.cdiv(F, 16), body, init())

  if ns == 0:
    m, l, accs = fp_part()
  else:
    m, l, accs = jax.lax.cond(sidx < ns, quant_part, fp_part)
  r["o_lo"][...] = accs[0]
  if n_out:
    r["o_out"][...] = accs[1]
  r["m"][...] = m
  r["l"][...] = l


def _choose_splits(num_blocks, batch_heads, num_splits):
  if num_blocks == 0:
    return 0, 1
  if num_splits is None:
    num_splits = max(1, -(-_TARGET_PROGRAMS // batch_heads))
  num_splits = max(1, min(int(num_splits), num_blocks))
  bps = -(-num_blocks // num_splits)
  return -(-num_blocks // bps), bps


def _combine(m, l, outs):
  """Merges split partials: m, l [..., NS, G]; outs [..., NS, G, C] -> normalized [..., G, C]."""
  m_tot = jnp.max(m, axis=-2, keepdims=True)
  w = jnp.exp(m - m_tot)
  l_tot = jnp.sum(w * l, axis=-2)
  inv = jnp.where(l_tot > 0, 1.0 / jnp.where(l_tot > 0, l_tot, 1.0), 0.0)
  return [jnp.sum(w[..., None] * o, axis=-3) * inv[..., None] for o in outs]


def _pad_to(x, shape):
  return jnp.pad(x, [(0, t - s) for s, t in zip(x.shape, shape)])


@functools.partial(jax.jit, static_argnames=("sm_scale", "num_splits", "num_warps", "num_stages",
                                             "dequant", "operands", "loop", "interpret"))
def _decode_quant(q, kv, *, sm_scale, num_splits, num_warps, num_stages, dequant, operands, loop,
                  interpret):
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
  num_blocks = lay.cq // lay.pack_tokens
  ns, bps = _choose_splits(num_blocks, b * h, num_splits)

  qg = (q.astype(jnp.float32) * sm_scale).reshape(b, h, g, d)
  k_lo_idx = kq.low_channel_index(kv.k_outlier_idx, d)
  v_lo_idx = kq.low_channel_index(kv.v_outlier_idx, d)
  q_lo = jnp.take_along_axis(qg, k_lo_idx[:, :, None, :], axis=3)
  qdt = jnp.float32 if operands == "tf32" else jnp.bfloat16
  inputs = {
      "lengths": kv.lengths.astype(jnp.int32),
      "q_lo": _pad_to(q_lo, (b, h, gp, dt)).astype(qdt),
      "q_fp": _pad_to(qg, (b, h, gp, df)).astype(jnp.bfloat16),
      "k_fp": kv.k_fp, "v_fp": kv.v_fp,
      "v_lo_idx": _pad_to(v_lo_idx, (b, h, dt)),
  }
  if n_out:
    q_out = jnp.take_along_axis(qg, kv.k_outlier_idx[:, :, None, :], axis=3)
    inputs["q_out"] = _pad_to(q_out, (b, h, gp, nop)).astype(qdt)
    inputs["v_out_idx"] = _pad_to(kv.v_outlier_idx, (b, h, nop))
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
  out_names = list(out_shapes)

  def ospec(s):
    rest = s.shape[3:]
    return pl.BlockSpec((None, None, None) + rest, lambda bi, hi, si, n=len(rest): (bi, hi, si) + (0,) * n)

  kernel = functools.partial(
      _quant_kernel, names=names + out_names, lay=lay, ns=ns, bps=bps, gp=gp, dt=dt, df=df,
      nop=nop, num_groups_tok=lay.n_groups_tok, dequant=dequant, operands=operands, loop=loop)
  outs = pl.pallas_call(
      kernel,
      grid=(b, h, nsp),
      in_specs=[spec(inputs[n]) for n in names],
      out_specs=[ospec(out_shapes[n]) for n in out_names],
      out_shape=[out_shapes[n] for n in out_names],
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="decode_attention_quantized",
  )(*[inputs[n] for n in names])
  outs = dict(zip(out_names, outs))
  parts = [outs["o_lo"]] + ([outs["o_out"]] if n_out else [])
  comb = _combine(outs["m"], outs["l"], parts)
  o = jnp.zeros((b, h, g, d), jnp.float32)
  bi = jnp.arange(b)[:, None, None, None]
  hi = jnp.arange(h)[None, :, None, None]
  gi = jnp.arange(g)[None, None, :, None]
  o = o.at[bi, hi, gi, v_lo_idx[:, :, None, :]].set(comb[0][:, :, :g, :lay.d_low])
  if n_out:
    o = o.at[bi, hi, gi, kv.v_outlier_idx[:, :, None, :]].set(comb[1][:, :, :g, :n_out])
  return o.reshape(b, hq, d).astype(q.dtype)


def decode_attention(q: jax.Array, kv: kq.QuantizedKV, *, sm_scale: float | None = None,
                     num_splits: int | None = None, num_warps: int = 2, num_stages: int = 2,
                     dequant: str = "magic", operands: str = "tf32", loop: str = "slots",
                     interpret: bool | None = None) -> jax.Array:
  """Attention of one query token per sequence to a quantized KV cache.

  Args:
    q: ``[B, Hq, D]`` (any float dtype; the output has the same dtype). Query head
      ``i`` uses kv-head ``i // (Hq // H)``.
    kv: ``QuantizedKV`` with batch ``B``, ``H`` kv-heads, head dim ``D``; its
      ``lengths`` say how many positions each sequence attends to.
    sm_scale: softmax scale, default ``1 / sqrt(D)``.
    num_splits: programs per (sequence, kv-head) over the quantized region
      (default: enough to put ~512 programs on the device; 16-128 measured the same).
    num_warps: 2 by default: 1.5x faster than 4 at B=8, 32k on an H200
      (experiments/sweep_decode_splits.py).
    dequant: "magic" (codes moved into a float's mantissa; default) or
      "convert" (int->float conversion); same result up to rounding.
    operands: "tf32" (dequantized tiles go to the tensor cores as float32/tf32;
      default) or "bf16".
    loop: "slots" (one 16-token slot per loop iteration, the word tile re-read
      from L1; default), "slots_carry" (word tile kept in registers across a
      tile's slots) or "unrolled" (all slots of a tile in one iteration).
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
  if dequant not in ("magic", "convert"):
    raise ValueError(f"dequant must be 'magic' or 'convert', got {dequant!r}")
  if operands not in ("tf32", "bf16"):
    raise ValueError(f"operands must be 'tf32' or 'bf16', got {operands!r}")
  if loop not in ("slots", "slots_carry", "unrolled"):
    raise ValueError(f"loop must be 'slots', 'slots_carry' or 'unrolled', got {loop!r}")
  sm_scale = float(1.0 / math.sqrt(d) if sm_scale is None else sm_scale)
  return _decode_quant(q, kv, sm_scale=sm_scale, num_splits=num_splits, num_warps=num_warps,
                       num_stages=num_stages, dequant=dequant, operands=operands, loop=loop,
                       interpret=resolve_interpret(interpret))


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
  qg = (q.astype(jnp.float32) * sm_scale).reshape(b, h, g, d)
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
  return _decode_bf16(q, k, v, lengths, sm_scale=sm_scale, block_k=block_k, num_splits=num_splits,
                      num_warps=num_warps, num_stages=num_stages,
                      interpret=resolve_interpret(interpret))
