"""Grouped-query attention with rotary embeddings; causal over a sequence or a KV cache.

Beyond the project's shape legend: P = (H + 2N) * A, the columns of the fused q|k|v
projection (`Attention.fuse_projections`, the decode layout).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.model.layers import RMSNorm, RopeScaling, normal_init, rope


def gqa_attention(q_BTHA, k_BSNA, v_BSNA, mask_BTS):
  """softmax(q k^T / sqrt(A)) v with H = N * G query heads, G sharing each kv head.

  q_BTHA: [B, T, H, A]; k/v_BSNA: [B, S, N, A]; mask_BTS: True where a key is visible.
  Scores and softmax in float32. Returns [B, T, H, A] in q's dtype.
  """
  B, T, H, A = q_BTHA.shape
  N = k_BSNA.shape[2]
  q_BTNGA = q_BTHA.reshape(B, T, N, H // N, A)
  scores_BNGTS = jnp.einsum("btnga,bsna->bngts", q_BTNGA, k_BSNA,
                            preferred_element_type=jnp.float32) * (A ** -0.5)
  scores_BNGTS = jnp.where(mask_BTS[:, None, None], scores_BNGTS, -1e30)
  probs_BNGTS = jax.nn.softmax(scores_BNGTS, axis=-1)
  out_BTNGA = jnp.einsum("bngts,bsna->btnga", probs_BNGTS.astype(v_BSNA.dtype), v_BSNA,
                         preferred_element_type=jnp.float32)
  return out_BTNGA.reshape(B, T, H, A).astype(q_BTHA.dtype)


def causal_mask(T: int) -> jax.Array:
  return jnp.tril(jnp.ones((T, T), dtype=bool))[None]


def resolve_attention_impl(implementation: str, dtype) -> str:
  """model.attention_impl -> xla | cudnn. auto: cuDNN's fused flash attention where it runs
  (a GPU, 16-bit compute): it never writes the [T, S] scores to HBM, which the einsum path
  does for every head in the forward and again in the backward."""
  if implementation != "auto":
    return implementation
  half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  return "cudnn" if half and jax.default_backend() == "gpu" else "xla"


def causal_attention(q_BTHA, k_BTNA, v_BTNA, implementation: str = "xla"):
  """Causal GQA over one sequence (no cache): gqa_attention with the causal mask, or
  jax.nn.dot_product_attention's cuDNN kernel (float32 softmax inside as well)."""
  if resolve_attention_impl(implementation, q_BTHA.dtype) == "cudnn":
    return jax.nn.dot_product_attention(q_BTHA, k_BTNA, v_BTNA, is_causal=True,
                                        implementation="cudnn")
  return gqa_attention(q_BTHA, k_BTNA, v_BTNA, causal_mask(q_BTHA.shape[1]))


class Attention(nnx.Module):
  def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
               rope_theta: float, rngs: nnx.Rngs, std: float, dtype, param_dtype,
               qkv_bias: bool = False, qk_norm: str = "none", clip_qkv: float = 0.0,
               norm_eps: float = 1e-6, rope_scaling: RopeScaling | None = None,
               implementation: str = "auto"):
    # Parameter names predate the shape legend (K = kv heads, d = head dim there); they are
    # checkpoint keys, so they stay: wq_DHd is [D, H*A], wk/wv_DKd [D, N*A], wo_HdD [H*A, D].
    # The optional parts (model.qkv_bias, qk_norm) exist only when configured, so a model
    # without them has exactly the keys it always had.
    init = normal_init(std)
    H, N, A = num_heads, num_kv_heads, head_dim
    self.wq_DHd = nnx.Param(init(rngs.params(), (d_model, H * A), param_dtype))
    self.wk_DKd = nnx.Param(init(rngs.params(), (d_model, N * A), param_dtype))
    self.wv_DKd = nnx.Param(init(rngs.params(), (d_model, N * A), param_dtype))
    self.wo_HdD = nnx.Param(init(rngs.params(), (H * A, d_model), param_dtype))
    if qkv_bias:
      self.q_bias_HA = nnx.Param(jnp.zeros((H * A,), param_dtype))
      self.k_bias_NA = nnx.Param(jnp.zeros((N * A,), param_dtype))
      self.v_bias_NA = nnx.Param(jnp.zeros((N * A,), param_dtype))
    self.qkv_bias, self.qk_norm, self.clip_qkv = qkv_bias, qk_norm, clip_qkv
    if qk_norm != "none":
      # head: one scale of A shared by all heads; full: one per channel of the projection.
      q_dim, k_dim = (A, A) if qk_norm == "head" else (H * A, N * A)
      self.q_norm = RMSNorm(q_dim, eps=norm_eps, param_dtype=param_dtype)
      self.k_norm = RMSNorm(k_dim, eps=norm_eps, param_dtype=param_dtype)
    self.num_heads, self.num_kv_heads, self.head_dim = H, N, A
    self.rope_theta, self.rope_scaling, self.dtype = rope_theta, rope_scaling, dtype
    self.implementation = implementation   # causal_attention's, without a cache

  def fuse_projections(self) -> None:
    """Replaces wq, wk, wv by one [D, P] weight (q | k | v columns), in place: the decode
    layout, one weight read per step instead of three (at one token per sequence the two
    [D, N*A] matmuls ran at a fraction of the copy rate). Not a checkpoint layout:
    inference applies it after restoring."""
    if hasattr(self, "wqkv_DP"):
      return
    self.wqkv_DP = nnx.Param(jnp.concatenate(
        [self.wq_DHd[...], self.wk_DKd[...], self.wv_DKd[...]], axis=1))
    del self.wq_DHd, self.wk_DKd, self.wv_DKd

  def project_qkv(self, x_BTD, positions_BT):
    B, T, _ = x_BTD.shape
    c = lambda p: p[...].astype(self.dtype)
    if hasattr(self, "wqkv_DP"):
      HA, NA = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
      q, k, v = jnp.split(x_BTD @ c(self.wqkv_DP), [HA, HA + NA], axis=-1)
    else:
      q, k, v = x_BTD @ c(self.wq_DHd), x_BTD @ c(self.wk_DKd), x_BTD @ c(self.wv_DKd)
    if self.qkv_bias:
      q, k, v = q + c(self.q_bias_HA), k + c(self.k_bias_NA), v + c(self.v_bias_NA)
    if self.qk_norm == "full":
      q, k = self.q_norm(q), self.k_norm(k)
    q_BTHA = q.reshape(B, T, self.num_heads, self.head_dim)
    k_BTNA = k.reshape(B, T, self.num_kv_heads, self.head_dim)
    v_BTNA = v.reshape(B, T, self.num_kv_heads, self.head_dim)
    if self.qk_norm == "head":
      q_BTHA, k_BTNA = self.q_norm(q_BTHA), self.k_norm(k_BTNA)
    if self.clip_qkv > 0:
      q_BTHA, k_BTNA, v_BTNA = (jnp.clip(t, -self.clip_qkv, self.clip_qkv)
                                for t in (q_BTHA, k_BTNA, v_BTNA))
    return (rope(q_BTHA, positions_BT, self.rope_theta, self.rope_scaling),
            rope(k_BTNA, positions_BT, self.rope_theta, self.rope_scaling), v_BTNA)

  def output(self, o_BTHA):
    B, T = o_BTHA.shape[:2]
    return o_BTHA.reshape(B, T, -1) @ self.wo_HdD[...].astype(self.dtype)

  def __call__(self, x_BTD, positions_BT, cache=None):
    """Causal self-attention. With `cache` (see kv_cache.py), the new keys/values extend it
    and attention reads everything it holds; returns (y_BTD, new_cache)."""
    q, k, v = self.project_qkv(x_BTD, positions_BT)
    if cache is None:
      return self.output(causal_attention(q, k, v, self.implementation)), None
    o, cache = cache.extend(q, k, v, positions_BT)
    return self.output(o.astype(self.dtype)), cache
