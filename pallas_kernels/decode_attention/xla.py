"""Decode attention as plain XLA ops: the implementation for devices without a kernel here
(TPU for an unquantized cache, where XLA already streams K and V) and the fallback of last
resort for a quantized one (the cache is dequantized first: it costs the HBM the kernels
save, so it is never the default on a GPU)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kv.quant import QuantizedKV


def _attend(q, k, v, valid, sm_scale):
  """q [B, H, A]; k, v [B, N, S, A]; valid bool[B, S] -> [B, H, A] (float32 softmax)."""
  b, hq, d = q.shape
  n = k.shape[1]
  q_BNGA = q.reshape(b, n, hq // n, d).astype(k.dtype)
  s = jnp.einsum("bnga,bnsa->bngs", q_BNGA, k, preferred_element_type=jnp.float32) * sm_scale
  s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
  den = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(den > 0, den, 1.0)
  o = jnp.einsum("bngs,bnsa->bnga", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return o.reshape(b, hq, d).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def _quantized(q, kv, *, sm_scale):
  k, v, valid = kv.dequantize(jnp.bfloat16)
  return _attend(q, k, v, valid, sm_scale)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def _bf16(q, k, v, lengths, *, sm_scale):
  valid = jnp.arange(k.shape[2])[None, :] < lengths[:, None]
  return _attend(q, k, v, valid, sm_scale)


def decode_attention_xla(q: jax.Array, kv: QuantizedKV, *, sm_scale: float, config=None,
                         interpret: bool = False) -> jax.Array:
  """``q [B, H, A]`` attended to the dequantized cache -> ``[B, H, A]``. No knobs."""
  del config, interpret
  return _quantized(q, kv, sm_scale=float(sm_scale))


def decode_attention_bf16_xla(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
                              sm_scale: float, config=None, interpret: bool = False) -> jax.Array:
  """``q [B, H, A]``, ``k, v [B, N, S, A]``, ``lengths int[B]`` -> ``[B, H, A]``. No knobs."""
  del config, interpret
  return _bf16(q, k, v, jnp.asarray(lengths), sm_scale=float(sm_scale))
