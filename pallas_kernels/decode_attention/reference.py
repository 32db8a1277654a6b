"""Decode attention in float32, plainly: the ground truth of every implementation here.

Only the tests import this file (the production XLA implementation is ``xla.py``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def decode_attention(q, k, v, valid, sm_scale=None):
  """Reference decode attention in float32.

  q [B, H, A]; k, v [B, N, S, A]; valid bool[B, S]. Query head i uses kv-head
  i // (H // N). Rows with no valid position give zeros.
  """
  b, hq, d = q.shape
  h = k.shape[1]
  g = hq // h
  scale = (1.0 / d ** 0.5) if sm_scale is None else sm_scale
  qg = q.astype(jnp.float32).reshape(b, h, g, d)
  s = jnp.einsum("bhgd,bhtd->bhgt", qg, k.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST) * scale
  s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.where(valid[:, None, None, :], jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  den = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(den > 0, den, 1.0)
  o = jnp.einsum("bhgt,bhtd->bhgd", p, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  return o.reshape(b, hq, d)


def quantized_decode_attention(q, kv, sm_scale=None):
  """Reference of ``decode_attention``: dequantize the cache, then attend."""
  k, v, valid = kv.dequantize(jnp.float32)
  return decode_attention(q, k, v, valid, sm_scale)


def decode_attention_bf16(q, k, v, lengths, sm_scale=None):
  """Reference of ``decode_attention_bf16``."""
  valid = jnp.arange(k.shape[2])[None, :] < jnp.asarray(lengths)[:, None]
  return decode_attention(q, k, v, valid, sm_scale)
