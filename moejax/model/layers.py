"""Small building blocks: RMSNorm, rotary embeddings, dense SwiGLU feed-forward."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def dtype_of(name: str):
  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def normal_init(std: float):
  return nnx.initializers.normal(stddev=std)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope(x_BTHA: jax.Array, positions_BT: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding (half-split convention) applied in float32.

  x_BTHA: [B, T, heads, A] (query or kv heads); rotates A/2 pairs of channels.
  """
  A = x_BTHA.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, A, 2, dtype=jnp.float32) / A))
  angles = positions_BT.astype(jnp.float32)[..., None] * inv_freq      # [B, T, A/2]
  sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
  x = x_BTHA.astype(jnp.float32)
  x1, x2 = x[..., : A // 2], x[..., A // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTHA.dtype)


class SwiGLU(nnx.Module):
  """Dense feed-forward: down(silu(x @ gate) * (x @ up))."""

  def __init__(self, d_model: int, hidden: int, *, rngs: nnx.Rngs, std: float, dtype, param_dtype):
    init = normal_init(std)
    self.w_gate_DF = nnx.Param(init(rngs.params(), (d_model, hidden), param_dtype))
    self.w_up_DF = nnx.Param(init(rngs.params(), (d_model, hidden), param_dtype))
    self.w_down_FD = nnx.Param(init(rngs.params(), (hidden, d_model), param_dtype))
    self.dtype = dtype

  def __call__(self, x_BTD):
    c = lambda p: p[...].astype(self.dtype)
    h = jax.nn.silu(x_BTD @ c(self.w_gate_DF)) * (x_BTD @ c(self.w_up_DF))
    return h @ c(self.w_down_FD)
