"""Plain ``jnp`` grouped matmul, loop-free and slow: the ground truth of ``pallas_kernels.gmm``.

Only the tests import this file. Rows of lhs are sorted by group: group g owns rows
[off[g], off[g+1]) with off = [0, cumsum(group_sizes)]; rows at or beyond
sum(group_sizes) give zeros. Everything is computed in float32 at HIGHEST precision.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def _group_of_row(group_sizes_E, m):
  """[M] int32: group id of each row; E for rows beyond sum(group_sizes)."""
  ends_E = jnp.cumsum(group_sizes_E.astype(jnp.int32))
  return jnp.searchsorted(ends_E, jnp.arange(m, dtype=jnp.int32), side="right")


def gmm(lhs_MI, rhs_EIO, group_sizes_E, preferred_element_type=None, transpose_rhs=False):
  """out [M, O]: out[m] = lhs[m] @ rhs[group(m)] (rhs[g].T if transpose_rhs); 0 past the groups."""
  out_dtype = preferred_element_type or lhs_MI.dtype
  if transpose_rhs:
    rhs_EIO = jnp.swapaxes(rhs_EIO, 1, 2)
  e = rhs_EIO.shape[0]
  gid_M = _group_of_row(group_sizes_E, lhs_MI.shape[0])
  w_MIO = rhs_EIO[jnp.minimum(gid_M, e - 1)].astype(jnp.float32)
  out_MO = jnp.einsum("mi,mio->mo", lhs_MI.astype(jnp.float32), w_MIO, precision=_HI)
  out_MO = jnp.where((gid_M < e)[:, None], out_MO, 0.0)
  return out_MO.astype(out_dtype)


def tgmm(lhs_IM, rhs_MO, group_sizes_E, preferred_element_type=None):
  """out [E, I, O]: out[g] = lhs[:, rows of g] @ rhs[rows of g]; rows past the groups ignored."""
  out_dtype = preferred_element_type or lhs_IM.dtype
  e = group_sizes_E.shape[0]
  gid_M = _group_of_row(group_sizes_E, rhs_MO.shape[0])
  onehot_ME = (gid_M[:, None] == jnp.arange(e)[None, :]).astype(jnp.float32)
  out_EIO = jnp.einsum("im,me,mo->eio", lhs_IM.astype(jnp.float32), onehot_ME,
                       rhs_MO.astype(jnp.float32), precision=_HI)
  return out_EIO.astype(out_dtype)


def dequantize_expert_weights(codes, scales_EQO, bits, group_size):
  """w [E, I, O] f32 = code[e, i, o] * scale[e, i // group_size, o] (Q = 1: group_size None).

  codes: int8 [E, I, O] (bits 8) or uint8 [E, I/2, O] (bits 4: byte (i, o) holds
  code(i) + 8 in bits 0-3, code(i + I/2) + 8 in bits 4-7), as pallas_kernels.gmm.quant.
  """
  c = codes.astype(jnp.int32)
  if bits == 4:  # one nibble at a time, by division (the library uses shifts and masks)
    c = jnp.concatenate([c % 16 - 8, c // 16 - 8], axis=1)
  i = c.shape[1]
  gs = i if group_size is None else group_size
  scale_EIO = jnp.repeat(scales_EQO.astype(jnp.float32), gs, axis=1)
  return c.astype(jnp.float32) * scale_EIO
