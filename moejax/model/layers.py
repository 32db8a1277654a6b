"""Small building blocks: RMSNorm, rotary embeddings, dense SwiGLU feed-forward."""
from __future__ import annotations

import dataclasses
import math

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


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Context extension of the rotary frequencies (model.rope_scaling and its rope_* fields).
  linear: every frequency / factor. llama3 (Llama 3.1): wavelengths longer than
  original_max_len / low_freq_factor are scaled by 1 / factor, shorter than
  original_max_len / high_freq_factor kept, and those between interpolated."""
  kind: str = "none"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_len: int = 8192


def rope_frequencies(A: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
  """[A/2] float32 inverse frequencies of rotary channel pairs."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, A, 2, dtype=jnp.float32) / A))
  if scaling is None or scaling.kind == "none":
    return inv_freq
  if scaling.kind == "linear":
    return inv_freq / scaling.factor
  if scaling.kind != "llama3":
    raise ValueError(f"unknown rope scaling {scaling.kind!r}")
  s = scaling
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > s.original_max_len / s.low_freq_factor, inv_freq / s.factor,
                     inv_freq)
  smooth = ((s.original_max_len / wavelen - s.low_freq_factor)
            / (s.high_freq_factor - s.low_freq_factor))
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = ((wavelen >= s.original_max_len / s.high_freq_factor)
            & (wavelen <= s.original_max_len / s.low_freq_factor))
  return jnp.where(medium, smoothed, scaled)


def rope(x_BTHA: jax.Array, positions_BT: jax.Array, theta: float,
         scaling: RopeScaling | None = None) -> jax.Array:
  """Rotary position embedding (half-split convention, as Hugging Face's rotate_half)
  applied in float32.

  x_BTHA: [B, T, heads, A] (query or kv heads); rotates A/2 pairs of channels (c, c + A/2).
  """
  A = x_BTHA.shape[-1]
  inv_freq = rope_frequencies(A, theta, scaling)
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


@jax.custom_vjp
def lm_head_logits(x_BTD: jax.Array, head_DV: jax.Array) -> jax.Array:
  """float32 logits of x @ head, both in the compute dtype.

  The custom backward casts the logits' float32 cotangent to the compute dtype first. Left
  to autodiff, the two backward GEMMs take a float32 operand and run as tf32 GEMMs on the
  widest tensor of the step ([B*T, V]); in bf16 they are plain bf16 GEMMs (float32
  accumulate). With float32 compute the cast is a no-op and the gradients are exact.
  """
  return jnp.dot(x_BTD, head_DV, preferred_element_type=jnp.float32)


def _lm_head_fwd(x_BTD, head_DV):
  return lm_head_logits(x_BTD, head_DV), (x_BTD, head_DV)


def _lm_head_bwd(residuals, dlogits_BTV):
  x_BTD, head_DV = residuals
  g_BTV = dlogits_BTV.astype(x_BTD.dtype)
  dx_BTD = jnp.einsum("...v,dv->...d", g_BTV, head_DV, preferred_element_type=jnp.float32)
  dhead_DV = jnp.einsum("...d,...v->dv", x_BTD, g_BTV, preferred_element_type=jnp.float32)
  return dx_BTD.astype(x_BTD.dtype), dhead_DV.astype(head_DV.dtype)


lm_head_logits.defvjp(_lm_head_fwd, _lm_head_bwd)
