"""Merging decode-attention partials (plain jnp): the kernels' split partials over the
quantized region, plus the sinks and window ring, into one normalized output.

Partials are unnormalized and in log2 units (queries pre-scaled by
``sm_scale * log2(e)``; ``exp2`` throughout). The quantized region's value outputs
come in the cache's split form: ``o_lo`` over the non-outlier channels in cache
order (padded to ``D_pad``), ``o_out`` over the outlier channels.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv import layout as kl
from pallas_kernels.kv.quant import QuantizedKV

NEG = -1e30                    # "minus infinity" that keeps exp2(NEG - NEG) finite
LOG2E = 1.4426950408889634


def scaled_queries(q, num_kv_heads: int, sm_scale: float):
  """q ``[B, H, A]`` -> float32 ``[B, N, G, A]`` (G = H / N) scaled by ``sm_scale * log2(e)``
  (the kernels' softmax runs in log2 units)."""
  b, hq, d = q.shape
  return (q.astype(jnp.float32) * (sm_scale * LOG2E)).reshape(b, num_kv_heads, hq // num_kv_heads, d)


def pad_to(x, shape):
  return jnp.pad(x, [(0, t - s) for s, t in zip(x.shape, shape)])


def combine(m, l, outs):
  """Merges split partials: m (log2 units), l [..., NS, G]; outs [..., NS, G, C] -> normalized [..., G, C]."""
  m_tot = jnp.max(m, axis=-2, keepdims=True)
  w = jnp.exp2(m - m_tot)
  l_tot = jnp.sum(w * l, axis=-2)
  inv = jnp.where(l_tot > 0, 1.0 / jnp.where(l_tot > 0, l_tot, 1.0), 0.0)
  return [jnp.sum(w[..., None] * o, axis=-3) * inv[..., None] for o in outs]


def fp_partial(qg, kv: QuantizedKV):
  """Sinks and window ring: (m, l [B, N, G], o [B, N, G, A]) in channel order.

  qg: ``[B, N, G, A]`` float32 queries, already scaled (log2 units)."""
  lay = kv.layout
  cfg = lay.config
  pos, held = kl.fp_slot_positions(lay, kv.lengths)
  nq = lay.num_quantized(kv.lengths)
  s_ = cfg.sink_tokens
  valid = held & ((pos < s_) | (pos >= s_ + nq[:, None]))                        # [B, F]
  s = jnp.einsum("bhgd,bhfd->bhgf", qg, kv.k_fp.astype(jnp.float32))
  s = jnp.where(valid[:, None, None, :], s, NEG)
  m = s.max(-1)
  p = jnp.where(valid[:, None, None, :], jnp.exp2(s - m[..., None]), 0.0)
  return m, p.sum(-1), jnp.einsum("bhgf,bhfd->bhgd", p, kv.v_fp.astype(jnp.float32))


def merge_partials(qg, kv: QuantizedKV, m, l, o_lo, o_out) -> jax.Array:
  """Quantized-region partials + the full-precision part -> ``[B, N, G, A]`` float32.

  m, l: ``[B, N, NS, G]``; o_lo: ``[B, N, NS, G, D_pad]``; o_out: ``[B, N, NS, G, n_out]``
  (ignored without outlier channels). The split partials are put in channel order by a
  gather (a scatter or sort here costs more than the kernel on small calls)."""
  lay = kv.layout
  mf, lf, of = fp_partial(qg, kv)
  pos = kl.channel_positions(kv.v_outlier_idx, lay.head_dim)[:, :, None, None, :]
  o_q = kl.from_split(o_lo, o_out, pos, lay.n_out)                                # [B,H,NS,g,D]
  m = jnp.concatenate([m, mf[:, :, None]], axis=2)
  l = jnp.concatenate([l, lf[:, :, None]], axis=2)
  (o,) = combine(m, l, [jnp.concatenate([o_q, of[:, :, None]], axis=2)])
  return o
