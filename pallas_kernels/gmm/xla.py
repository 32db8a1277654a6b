"""The grouped matmul as XLA ops: ``jax.lax.ragged_dot`` / ``ragged_dot_general``.

Runs on every platform (the fallback after the Pallas kernels). Differentiable by jax's
own rules (gmm; tgmm is forward only: jax has no transpose for its ragged-contracting
form). Quantized weights are dequantized first to lhs's dtype, so the float weights
are materialized: no byte saving here. Products use jax's default matmul precision;
accumulation is float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gmm.quant import QuantizedExpertWeights, dequantize_expert_weights


def _clipped_sizes(group_sizes_E, m: int):
  """Sizes clipped so that their sum is at most m (the public contract)."""
  ends_E = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes_E.astype(jnp.int32), 0)), m)
  return jnp.diff(ends_E, prepend=jnp.zeros((1,), jnp.int32))


def gmm(lhs_MI, rhs, group_sizes_E, *, out_dtype):
  """out [M, O] = lhs[m] @ rhs[group(m)]; rhs [E, I, O] float or QuantizedExpertWeights.

  Rows at or beyond sum(group_sizes) are zero (ragged_dot's contract).
  """
  if isinstance(rhs, QuantizedExpertWeights):
    # Weights are constants of the quantized path (gradient w.r.t. lhs only).
    rhs = jax.lax.stop_gradient(dequantize_expert_weights(rhs, lhs_MI.dtype))
  dtype = jnp.promote_types(lhs_MI.dtype, rhs.dtype)
  out_MO = jax.lax.ragged_dot(
      lhs_MI.astype(dtype), rhs.astype(dtype), _clipped_sizes(group_sizes_E, lhs_MI.shape[0]),
      preferred_element_type=jnp.float32)
  return out_MO.astype(out_dtype)


def tgmm(lhs, rhs_MO, group_sizes_E, *, lhs_im: bool, out_dtype):
  """out [E, I, O]: out[g] = lhs[rows of g].T @ rhs[rows of g]; lhs [M, I] or [I, M] (lhs_im)."""
  m_dim = 1 if lhs_im else 0
  dtype = jnp.promote_types(lhs.dtype, rhs_MO.dtype)
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([m_dim], [0]), ([], [])),
      lhs_ragged_dimensions=[m_dim], rhs_group_dimensions=[])
  out_EIO = jax.lax.ragged_dot_general(
      lhs.astype(dtype), rhs_MO.astype(dtype),
      _clipped_sizes(group_sizes_E, rhs_MO.shape[0]), dims,
      preferred_element_type=jnp.float32)
  return out_EIO.astype(out_dtype)
