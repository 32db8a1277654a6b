"""Decode attention (one query token per sequence) on a packed, quantized KV cache, as a
Pallas Triton kernel: any CUDA GPU and any layout the quantizer writes, and interpret mode
on CPU (which is what CI tests). ``triton_bf16.py`` is the same kernel shape on a plain
bf16 cache.

* grid ``(B, N, num_splits + 1)``. Program ``(b, n, s < num_splits)`` walks its share of
  the quantized region ``step_tokens`` (32) tokens per loop step (half of a 64-token code
  *slot*): the ``[32, D_pad]`` uint16 code words of those tokens (``kv.quant`` layout) are
  dequantized to a ``[32, D_pad]`` fp16 tile in registers (inline PTX, two values per
  32-bit register: see ``_dequant``), then ``scores = q_low . k^T`` on the tensor cores (+
  the 16-bit outlier channels), one online-softmax update (exp2; log2(e) is folded into the
  query), ``acc += p . v``. Slots past the sequence's quantized length are skipped. The
  last program ``(b, n, num_splits)`` attends to the full-precision sinks and window ring.
* Each program writes a partial (unnormalized output, running max, running sum); a small
  ``jnp`` step combines the ``num_splits + 1`` partials.
* Outlier channels cost no gather in the hot loop: the query is split outside it into
  ``q_low`` (the low-bit channels, in cache order) and ``q_out`` (the outlier channels);
  the value output is produced in the same split form and put back in channel order on
  the ``[B, H, A]`` result. Up to four outlier channels are rank-1 updates on the CUDA
  cores; more go through a padded tensor-core dot.

Nothing is dequantized to HBM. Interpreted, the dequantization runs as the same arithmetic
in ``jnp``; tests/decode_attention/test_gpu.py checks the PTX path on a GPU.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.kv import layout as kl
from pallas_kernels.kv.quant import QuantizedKV
from pallas_kernels.decode_attention.merge import NEG, scaled_queries
from pallas_kernels.decode_attention.merge import combine as _combine, pad_to as _pad_to
from pallas_kernels import _implementation as impl_lib
from pallas_kernels._implementation import Unsupported

_FMA_OUTLIERS = 4         # up to this many outlier channels: CUDA-core updates, not a dot


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """Knobs of the quantized Triton kernel. 1 warp, 1 stage, 15 splits was the fastest of 26
  variants on an H200 at B=8, 32k (0.354 ms; 2 warps 0.484, 4 warps 0.881).

  num_splits: programs per (sequence, kv-head) over the quantized region (None: about
    ``target_programs`` in all, ~8 per SM). step_tokens: tokens per unit of work, 32 (half
    a 64-token code slot) or 16 (smaller register tiles). slots_per_step: units per loop
    step (1, 2 or 4): one softmax rescale per step."""
  num_splits: int | None = None
  target_programs: int = 1024
  num_warps: int = 1
  num_stages: int = 1
  slots_per_step: int = 1
  step_tokens: int = 32

  def __post_init__(self):
    if self.slots_per_step not in (1, 2, 4):
      raise ValueError(f"slots_per_step must be 1, 2 or 4, got {self.slots_per_step!r}")
    if self.step_tokens not in (16, 32):
      raise ValueError(f"step_tokens must be 16 or 32, got {self.step_tokens!r}")
    _check_splits(self.num_splits)


def _check_splits(num_splits):
  if num_splits is not None and (isinstance(num_splits, bool) or int(num_splits) < 1):
    raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")


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


def _quant_kernel(*refs, names, lay: kl.KVLayout, ns, bps, gp, dt, df, nop, use_asm, U, T):
  r = dict(zip(names, refs))
  cfg = lay.config
  bits, cpw, G = cfg.bits, lay.cpw, cfg.group_size
  W = kl.PACK_STRIDE                 # word rows per pack tile (= tokens per code slot)
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
    nslot = jnp.clip((nq - slot0 * T + T - 1) // T, 0, bps)

    def locate(gs):
      """(t0, code slot j in its word tile, word rows) of unit gs: tokens [t0, t0 + T)."""
      gs = jnp.minimum(gs, cq // T - 1)          # a step's spare unit stays in bounds (masked)
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
      if G < T:                                  # nq is a multiple of G only
        valid = valid & (t0 + arT < nq)
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


def _choose_splits(num_blocks, batch_heads, num_splits, target_programs):
  if num_blocks == 0:
    return 0, 1
  if num_splits is None:
    num_splits = max(1, -(-target_programs // batch_heads))
  num_splits = max(1, min(int(num_splits), num_blocks))
  bps = -(-num_blocks // num_splits)
  return -(-num_blocks // bps), bps



@functools.partial(jax.jit, static_argnames=("sm_scale", "config", "interpret"))
def _decode_quant(q, kv, *, sm_scale, config: TritonConfig, interpret):
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
  ns, bps = _choose_splits(lay.cq // config.step_tokens, b * h, config.num_splits,
                           config.target_programs)

  qg = scaled_queries(q, h, sm_scale)
  k_lo_idx = kl.low_channel_index(kv.k_outlier_idx, d)
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
      nop=nop, use_asm=not interpret, U=config.slots_per_step, T=config.step_tokens)
  outs = pl.pallas_call(
      kernel,
      grid=(b, h, nsp),
      in_specs=[spec(inputs[n]) for n in names],
      out_specs=[ospec(n) for n in out_names],
      out_shape=[out_shapes[n] for n in out_names],
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name="decode_attention_quantized",
  )(*[inputs[n] for n in names])
  outs = dict(zip(out_names, outs))
  # Splits 0..ns-1 hold the quantized region in split form, put back in channel order by a
  # gather (no scatter: on small calls one costs more than the kernel); the last split's
  # partial is o_fp (sinks and window, already in channel order).
  pos = kl.channel_positions(kv.v_outlier_idx, d)[:, :, None, None, :]
  o_out = outs["o_out"][:, :, :ns] if n_out else None
  o_q = kl.from_split(outs["o_lo"][:, :, :ns], o_out, pos, n_out)
  parts = jnp.concatenate([o_q, outs["o_fp"][:, :, None, :, :d]], axis=2)      # [B,H,ns+1,gp,D]
  (o,) = _combine(outs["m"], outs["l"], [parts])
  o = o[:, :, :g]
  return o.reshape(b, hq, d).astype(q.dtype)


def _check_compilable(interpret: bool):
  if not interpret and impl_lib.platform() != "gpu":
    raise Unsupported(f"the Triton kernel compiles for GPUs only (device: {impl_lib.platform()}); "
                      "interpret=True runs it anywhere")


def decode_attention_triton(q: jax.Array, kv: QuantizedKV, *, sm_scale: float,
                            config: TritonConfig | None = None, interpret: bool = False) -> jax.Array:
  """``q [B, H, A]`` attended to ``kv`` -> ``[B, H, A]``; every layout."""
  _check_compilable(interpret)
  return _decode_quant(q, kv, sm_scale=float(sm_scale), config=config or TritonConfig(),
                       interpret=bool(interpret))
