"""Plain ``jnp`` versions of every kernel in ``pallas_kernels``: the ground truth.

Tests compare each Pallas kernel against the function of the same name here.
Nothing in this file is meant to be fast.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# --- packing / KV quantization / decode attention -------------------------


# --- grouped matmul ---------------------------------------------------------
# Rows of lhs are sorted by group: group g owns rows [off[g], off[g+1]) with
# off = [0, cumsum(group_sizes)]. Rows at or beyond sum(group_sizes) give zeros.


def _group_of_row(group_sizes_E, m):
  """[M] int32: group id of each row; E for rows beyond sum(group_sizes)."""
  ends_E = jnp.cumsum(group_sizes_E.astype(jnp.int32))
  return jnp.searchsorted(ends_E, jnp.arange(m, dtype=jnp.int32), side="right")


def gmm(lhs_MK, rhs_EKN, group_sizes_E, preferred_element_type=None,
        transpose_rhs=False):
  """out[m] = lhs[m] @ rhs[group(m)] (rhs[g].T if transpose_rhs); 0 past the groups."""
  out_dtype = preferred_element_type or lhs_MK.dtype
  if transpose_rhs:
    rhs_EKN = jnp.swapaxes(rhs_EKN, 1, 2)
  e = rhs_EKN.shape[0]
  gid_M = _group_of_row(group_sizes_E, lhs_MK.shape[0])
  w_MKN = rhs_EKN[jnp.minimum(gid_M, e - 1)].astype(jnp.float32)
  out_MN = jnp.einsum("mk,mkn->mn", lhs_MK.astype(jnp.float32), w_MKN,
                      precision=jax.lax.Precision.HIGHEST)
  out_MN = jnp.where((gid_M < e)[:, None], out_MN, 0.0)
  return out_MN.astype(out_dtype)


def tgmm(lhs_KM, rhs_MN, group_sizes_E, preferred_element_type=None):
  """out[g] = lhs[:, rows of g] @ rhs[rows of g]  -> [E, K, N]; rows past the groups ignored."""
  out_dtype = preferred_element_type or lhs_KM.dtype
  e = group_sizes_E.shape[0]
  gid_M = _group_of_row(group_sizes_E, rhs_MN.shape[0])
  onehot_ME = (gid_M[:, None] == jnp.arange(e)[None, :]).astype(jnp.float32)
  out_EKN = jnp.einsum("km,me,mn->ekn", lhs_KM.astype(jnp.float32), onehot_ME,
                       rhs_MN.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
  return out_EKN.astype(out_dtype)


def dequantize_expert_weights(codes_EKN, scales_EGN, bits, group_size):
  """Symmetric weight-only dequantization: w[e, k, n] = code * scale[e, k // group_size, n].

  codes_EKN holds signed integer codes already unpacked (int8 values in
  [-2**(bits-1), 2**(bits-1) - 1]); group_size None means one scale per
  output channel (scales_EGN has G = 1).
  """
  k = codes_EKN.shape[1]
  gs = k if group_size is None else group_size
  scale_EKN = jnp.repeat(scales_EGN.astype(jnp.float32), gs, axis=1)
  return codes_EKN.astype(jnp.float32) * scale_EKN
