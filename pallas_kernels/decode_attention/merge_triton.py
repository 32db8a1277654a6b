"""One Pallas (Triton) kernel for everything after the Mosaic decode kernel: the sinks and
window ring's attention, the merge of the split partials, and the return to channel order.

``merge.merge_partials`` (plain ``jnp``) computes the same. As XLA ops it is about seven
small kernels, ~13 us of GPU time per call on an H200 at B = 8, 32k (trace, 2026-12-03:
the attention kernel itself 110 us) and as many host launches; here it is one (4.7 us
there, 2026-12-04), which also scales the raw query and casts the output.

Program ``(b, n, c)`` (grid ``(B, N, A / d_chunk)``: each program merges ``d_chunk``
channels, by default sized for about ``MergeConfig.target_programs`` programs; the
window's scores are recomputed per chunk, a few hundred FLOPs):
  * window: ``s = q . k_fp^T`` over the full-precision slots (``window_step`` per step,
    float32-accurate dots: ``_dot_f32``), masked to the slots that hold a position outside
    the quantized region, online softmax -> ``m_f, l_f, o_f [G, A]`` (channel order);
  * splits: ``m_tot = max(m_f, max_s m_s)``, ``o = sum_s 2^(m_s - m_tot) o_s`` over the
    kernel's ``[D_pad, P]`` partials (heads minor, channels in split order);
  * channel order: the partials are loaded gathered, row ``pos_c`` of each for channel ``c``
    (``pos`` as ``kv.layout.channel_positions``, from the value outlier channels, in the
    kernel), ``splits_per_step`` splits per step;
  * ``(o + 2^(m_f - m_tot) o_f) / l_tot`` stored for the ``G`` real heads.
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
from pallas_kernels.decode_attention.merge import NEG
from pallas_kernels._implementation import resolve_interpret

MAX_UNROLL = 4          # loops of at most this many steps are unrolled (their loads can overlap)


@dataclasses.dataclass(frozen=True)
class MergeConfig:
  """Knobs of the merge kernel (H200, 2026-12-04, merge kernel alone).

  window_step: window slots per step (16, 32 or 64; 32 holds the default window ring, G =
    32, in one step). window_dot: "split" (three 16-bit tensor-core dots per float32
    product) or "f32" (IEEE float32 on the FMA units): B=8 32k 4.7 us split vs 9.1 f32.
  target_programs: channel chunks sized for about this many programs (a program is a chain
    of dependent loads, so the count matters more than the bytes).
  d_chunk: channels per program if it divides D (0: one program per head; None: from
    target_programs). splits_per_step: split partials per step (a power of two; [16, 32, 16]
    f32 is 64 registers a thread). unroll: loops of at most MAX_UNROLL steps unrolled.
  """
  window_step: int = 32
  window_dot: str = "split"
  target_programs: int = 128
  d_chunk: int | None = None
  splits_per_step: int = 16
  unroll: bool = True
  num_warps: int = 4

  def __post_init__(self):
    if self.window_step not in (16, 32, 64):
      raise ValueError(f"window_step must be 16, 32 or 64, got {self.window_step!r}")
    if self.window_dot not in ("split", "f32"):
      raise ValueError(f"window_dot must be 'split' or 'f32', got {self.window_dot!r}")
    if self.splits_per_step < 1 or self.splits_per_step & (self.splits_per_step - 1):
      raise ValueError(f"splits_per_step must be a power of two, got {self.splits_per_step}")


def _loop(n: int, body, carry, unroll: bool):
  """``fori_loop(0, n, body, carry)``; a Python loop when ``unroll`` and ``n <= MAX_UNROLL``
  (a short serial loop is a chain of dependent global loads: unrolled, they issue together)."""
  if unroll and n <= MAX_UNROLL:
    for i in range(n):
      carry = body(jnp.int32(i), carry)
    return carry
  return jax.lax.fori_loop(0, n, body, carry)


def _np2(n: int) -> int:
  return max(16, 1 << max(0, (int(n) - 1).bit_length()))


def _load(ref, idx, mask, other=0.0):
  return pltriton.load(ref.at[idx], mask=mask, other=jnp.asarray(other, ref.dtype))


def _dot_f32(a, b, *, split: bool, trans_b: bool = False):
  """``a @ b`` (or ``b^T``) for float32 ``a`` and 16-bit ``b``, to about float32 accuracy.

  ``split``: ``a`` as the sum of three terms in ``b``'s dtype, each a tensor-core dot with
  float32 accumulation (the products of 16-bit values are exact; the three terms carry
  24+ significant bits of ``a``). Else one IEEE float32 dot, which Triton runs on the FMA
  units through shared-memory layout conversions: slow (see MergeConfig.window_dot)."""
  if not split:       # IEEE (no tf32), as the jnp reference computes the window
    return pltriton.dot(a, b.astype(jnp.float32), trans_b=trans_b, allow_tf32=False)
  out, rest = None, a
  for _ in range(3):
    term = rest.astype(b.dtype)
    rest = rest - term.astype(jnp.float32)
    part = pltriton.dot(term, b, trans_b=trans_b)
    out = part if out is None else out + part
  return out


def _merge_kernel(len_ref, q_ref, kfp_ref, vfp_ref, vidx_ref, m_ref, l_ref, o_ref, out_ref, *,
                  lay: kl.KVLayout, g: int, n: int, ns: int, dc: int, splits: int, q_scale: float,
                  unroll: bool, fp_step: int, split_dot: bool):
  cfg = lay.config
  d, n_out = lay.head_dim, lay.n_out
  S, R, G, F, wc = cfg.sink_tokens, cfg.residual_window, cfg.group_size, lay.fp_slots, lay.ring
  gp, d2, dc2 = _np2(g), _np2(d), _np2(dc)
  c0 = pl.program_id(2) * dc                      # this program's channels: [c0, c0 + dc)
  L = len_ref[0]
  nq = jnp.minimum(jnp.maximum(L - S - R, 0) // G * G, lay.cq)
  rows, cols = jnp.arange(gp, dtype=jnp.int32), jnp.arange(d2, dtype=jnp.int32)
  own = jnp.arange(dc2, dtype=jnp.int32)
  chan = c0 + own                                 # [dc2] channels (channel order)
  cmask = (own < dc) & (chan < d)
  q = _load(q_ref, (rows[:, None], cols[None, :]), (rows[:, None] < g) & (cols[None, :] < d))
  q = q.astype(jnp.float32) * q_scale

  # sinks and window ring (channel order), as fp_partial; scores over all D, values of ours
  def window_step(i, carry):
    m, l, acc = carry
    slot = i * fp_step + jnp.arange(fp_step, dtype=jnp.int32)
    past = L - S                                    # tokens past the sinks
    p_ring = S + past - 1 - jnp.mod(past - 1 - (slot - S), wc)
    valid = jnp.where(slot < S, slot < L, (past > 0) & (p_ring >= S + nq)) & (slot < F)
    k = _load(kfp_ref, (slot[:, None], cols[None, :]),
              (slot[:, None] < F) & (cols[None, :] < d))
    s = jnp.where(valid[None, :], _dot_f32(q, k, split=split_dot, trans_b=True), NEG)   # [gp, step]
    m_new = jnp.maximum(m, s.max(axis=1))
    corr = jnp.exp2(m - m_new)
    p = jnp.where(valid[None, :], jnp.exp2(s - m_new[:, None]), 0.0)
    v = _load(vfp_ref, (slot[:, None], chan[None, :]),
              (slot[:, None] < F) & cmask[None, :])                       # [step, dc2]
    return m_new, l * corr + p.sum(axis=1), acc * corr[:, None] + _dot_f32(p, v, split=split_dot)

  init = (jnp.full((gp,), NEG, jnp.float32), jnp.zeros((gp,), jnp.float32),
          jnp.zeros((gp, dc2), jnp.float32))
  m_f, l_f, o_f = _loop(pl.cdiv(F, fp_step), window_step, init, unroll)

  # channel c sits at split position pos_c (kv_quant.channel_positions), from the value
  # outlier channels: the partials are read straight into channel order (a gathered load)
  oidx = jnp.arange(_np2(max(n_out, 1)), dtype=jnp.int32)
  idx = _load(vidx_ref, (oidx,), oidx < n_out, -1) if n_out else None
  below = jnp.zeros((dc2,), jnp.int32)
  slot_of = jnp.full((dc2,), -1, jnp.int32)
  for k in range(n_out):
    idx_k = jnp.sum(jnp.where(oidx == k, idx, 0))
    below += (idx_k < chan).astype(jnp.int32)
    slot_of = jnp.where(chan == idx_k, k, slot_of)
  pos = jnp.where(slot_of >= 0, d - n_out + slot_of, chan - below)
  pos = jnp.where(cmask, pos, 0)                                             # [dc2] rows of o

  # split partials: m, l [ns, n]; o [ns, dp, n] (heads minor), ``splits`` per step
  hmask = rows < n
  srows = jnp.arange(_np2(ns), dtype=jnp.int32)
  ml = (srows[:, None], rows[None, :])
  ml_mask = (srows[:, None] < ns) & hmask[None, :]
  m_all = _load(m_ref, ml, ml_mask, NEG)                                      # [ns2, gp]
  m_tot = jnp.maximum(m_f, m_all.max(axis=0))
  w_f = jnp.exp2(m_f - m_tot)
  l_tot = w_f * l_f + (jnp.exp2(m_all - m_tot[None, :]) * _load(l_ref, ml, ml_mask)).sum(axis=0)
  sb = jnp.arange(splits, dtype=jnp.int32)
  omask = cmask[None, :, None] & hmask[None, None, :]

  def split_step(i, acc_t):
    sp = i * splits + sb                                                     # [S] splits
    w = jnp.exp2(_load(m_ref, (sp[:, None], rows[None, :]), (sp[:, None] < ns) & hmask[None, :], NEG)
                 - m_tot[None, :])                                           # [S, gp]
    part = _load(o_ref, (sp[:, None, None], pos[None, :, None], rows[None, None, :]),
                 (sp[:, None, None] < ns) & omask)                           # [S, dc2, gp]
    return acc_t + (w[:, None, :] * part).sum(axis=0)

  acc_t = _loop(pl.cdiv(ns, splits), split_step, jnp.zeros((dc2, gp), jnp.float32), unroll)
  o = acc_t.T + w_f[:, None] * o_f                                           # [gp, dc2]
  inv = jnp.where(l_tot > 0, 1.0 / jnp.where(l_tot > 0, l_tot, 1.0), 0.0)
  out = (o * inv[:, None]).astype(out_ref.dtype)
  pltriton.store(out_ref.at[rows[:, None], own[None, :]], out,
                 mask=(rows[:, None] < g) & cmask[None, :])


def _channel_chunk(d: int, d_chunk: int | None, heads: int, target_programs: int) -> int:
  """Channels per program. ``d_chunk`` if it divides ``d`` (0: all of them); ``None``: a
  power of two in [16, d] giving ``heads * d / chunk`` about ``target_programs`` programs.
  H200, 2026-12-04 (merge kernel alone, us; experiments/trace_decode_small.py
  --merge-variants): B=8 x 8 heads, 32k: chunk 16 / 32 / 64 / 128 -> 26.5 / 14.7 / 10.4 /
  13.3; B=1, 32k: 10.6 / 12.5 / 14.6 / 44.8; B=1, 4k: 8.0 / 8.2 / 8.4 / 9.1."""
  if d_chunk is None:
    want = d * heads // target_programs
    d_chunk = min(d, max(16, 1 << max(0, want - 1).bit_length()))
  if d_chunk <= 0 or d % d_chunk:
    return d
  return int(d_chunk)


@functools.partial(jax.jit, static_argnames=("interpret", "q_scale", "out_dtype", "config"))
def merge_heads_minor(q_BNGA, kv: QuantizedKV, m, l, o_split, *, q_scale: float = 1.0,
                      out_dtype=jnp.float32, config: MergeConfig = MergeConfig(),
                      interpret: bool | None = None):
  """Sinks and window + split partials -> normalized ``[B, N, G, A]`` (``out_dtype``).

  q_BNGA: queries (any float dtype); ``q_BNGA * q_scale`` (in float32) must be the queries
  scaled by ``sm_scale * log2(e)`` (``q_scale=1``: already scaled). Scaling the query and
  casting the output here saves the caller two small XLA kernels (~1.5 us each on an H200).
  m, l: ``[B, N, NS, P]`` (log2 units; ``P >= G`` query heads, padded).
  o_split: ``[B, N, NS, D_pad, P]`` unnormalized, channels in split order (non-outlier
  channels ascending, then the ``n_out`` value outlier channels: ``A - n_out + k`` holds
  ``v_outlier_idx[..., k]``), padding channels ignored; heads minor, as the Mosaic kernel
  writes them. Equals ``merge.merge_partials`` on the same partials.
  """
  lay = kv.layout
  b, h, g, d = q_BNGA.shape
  ns, n = m.shape[2], m.shape[3]
  if o_split.shape != (b, h, ns, lay.d_pad, n) or l.shape != m.shape or n < g:
    raise ValueError(f"partials do not match: m {m.shape}, l {l.shape}, o_split {o_split.shape} "
                     f"(want [B, N, NS, P >= {g}] and [B, N, NS, {lay.d_pad}, P])")
  vidx = kv.v_outlier_idx.astype(jnp.int32)
  if not lay.n_out:
    vidx = jnp.zeros((b, h, 1), jnp.int32)
  vidx = jnp.broadcast_to(vidx, (b, h, vidx.shape[-1]))
  dc = _channel_chunk(d, config.d_chunk, b * h, config.target_programs)
  whole = lambda x: pl.BlockSpec((None, None) + x.shape[2:],
                                 lambda i, j, c, r=x.ndim - 2: (i, j) + (0,) * r)
  args = (kv.lengths.astype(jnp.int32), q_BNGA, kv.k_fp, kv.v_fp, vidx, m, l, o_split)
  specs = [pl.BlockSpec((1,), lambda i, j, c: (i,))] + [whole(x) for x in args[1:]]
  return pl.pallas_call(
      functools.partial(_merge_kernel, lay=lay, g=g, n=n, ns=ns, dc=dc,
                        splits=min(int(config.splits_per_step), 1 << max(0, ns - 1).bit_length()),
                        q_scale=float(q_scale), unroll=bool(config.unroll),
                        fp_step=int(config.window_step), split_dot=config.window_dot == "split"),
      grid=(b, h, d // dc),
      in_specs=specs,
      out_specs=pl.BlockSpec((None, None, g, dc), lambda i, j, c: (i, j, 0, c)),
      out_shape=jax.ShapeDtypeStruct((b, h, g, d), out_dtype),
      compiler_params=pltriton.CompilerParams(num_warps=int(config.num_warps), num_stages=2),
      interpret=resolve_interpret(interpret),
      name="decode_attention_merge",
  )(*args)
