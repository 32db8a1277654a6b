"""Grouped-query attention with rotary embeddings; causal over a sequence or a KV cache."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.model.layers import normal_init, rope


def gqa_attention(q_BTHD, k_BSKD, v_BSKD, mask_BTS):
  """softmax(q k^T / sqrt(D)) v with Hq = K * G query heads sharing each kv head.

  q_BTHD: [B, T, Hq, D]; k/v_BSKD: [B, S, Hkv, D]; mask_BTS: True where a key is visible.
  Scores and softmax in float32. Returns [B, T, Hq, D] in q's dtype.
  """
  B, T, H, D = q_BTHD.shape
  Hkv = k_BSKD.shape[2]
  q_BTKGD = q_BTHD.reshape(B, T, Hkv, H // Hkv, D)
  scores = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k_BSKD,
                      preferred_element_type=jnp.float32) * (D ** -0.5)
  scores = jnp.where(mask_BTS[:, None, None], scores, -1e30)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_BSKD.dtype), v_BSKD,
                   preferred_element_type=jnp.float32)
  return out.reshape(B, T, H, D).astype(q_BTHD.dtype)


def causal_mask(T: int) -> jax.Array:
  return jnp.tril(jnp.ones((T, T), dtype=bool))[None]


class Attention(nnx.Module):
  def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
               rope_theta: float, rngs: nnx.Rngs, std: float, dtype, param_dtype):
    init = normal_init(std)
    self.wq_DHd = nnx.Param(init(rngs.params(), (d_model, num_heads * head_dim), param_dtype))
    self.wk_DKd = nnx.Param(init(rngs.params(), (d_model, num_kv_heads * head_dim), param_dtype))
    self.wv_DKd = nnx.Param(init(rngs.params(), (d_model, num_kv_heads * head_dim), param_dtype))
    self.wo_HdD = nnx.Param(init(rngs.params(), (num_heads * head_dim, d_model), param_dtype))
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.rope_theta, self.dtype = rope_theta, dtype

  def project_qkv(self, x_BTD, positions_BT):
    B, T, _ = x_BTD.shape
    c = lambda p: p[...].astype(self.dtype)
    q = (x_BTD @ c(self.wq_DHd)).reshape(B, T, self.num_heads, self.head_dim)
    k = (x_BTD @ c(self.wk_DKd)).reshape(B, T, self.num_kv_heads, self.head_dim)
    v = (x_BTD @ c(self.wv_DKd)).reshape(B, T, self.num_kv_heads, self.head_dim)
    return rope(q, positions_BT, self.rope_theta), rope(k, positions_BT, self.rope_theta), v

  def output(self, o_BTHD):
    B, T = o_BTHD.shape[:2]
    return o_BTHD.reshape(B, T, -1) @ self.wo_HdD[...].astype(self.dtype)

  def __call__(self, x_BTD, positions_BT, cache=None):
    """Causal self-attention. With `cache` (see kv_cache.py), the new keys/values extend it
    and attention reads everything it holds; returns (y_BTD, new_cache)."""
    q, k, v = self.project_qkv(x_BTD, positions_BT)
    if cache is None:
      o = gqa_attention(q, k, v, causal_mask(x_BTD.shape[1]))
      return self.output(o), None
    o, cache = cache.extend(q, k, v, positions_BT)
    return self.output(o.astype(self.dtype)), cache
