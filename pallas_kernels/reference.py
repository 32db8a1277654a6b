"""Plain ``jnp`` versions of every kernel in ``pallas_kernels``: the ground truth.

Tests compare each Pallas kernel against the function of the same name here.
Nothing in this file is meant to be fast.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# --- packing / KV quantization / decode attention -------------------------
#
# Independent, loop-based versions of pallas_kernels.packing, kv_quant and
# decode_attention. Layouts are documented in those modules.

_CPW = {32: {2: 16, 3: 10, 4: 8, 8: 4}, 16: {2: 8, 3: 5, 4: 4, 8: 2}}
_WORD = {32: jnp.uint32, 16: jnp.uint16}


def _slot_source(nw, cpw, stride, j):
  """Element of the packed axis held by slot j of each of the nw words."""
  p = stride * cpw
  w = jnp.arange(nw)
  return (w // stride) * p + j * stride + w % stride


def pack(codes, bits, axis=-1, stride=1, word_bits=32):
  """Reference of packing.pack: element i of the axis -> word (i//P)*stride + (i%P)%stride,
  slot (i%P)//stride, P = stride*cpw; slot j occupies bits [j*bits, (j+1)*bits)."""
  cpw = _CPW[word_bits][bits]
  x = jnp.moveaxis(jnp.asarray(codes).astype(jnp.uint32), axis, -1)
  n = x.shape[-1]
  assert n % (stride * cpw) == 0
  nw = n // cpw
  acc = jnp.zeros(x.shape[:-1] + (nw,), jnp.uint32)
  for j in range(cpw):
    acc = acc | (x[..., _slot_source(nw, cpw, stride, j)] << (j * bits))
  return jnp.moveaxis(acc.astype(_WORD[word_bits]), -1, axis)


def unpack(words, bits, axis=-1, stride=1, dtype=jnp.uint8, word_bits=32):
  """Reference of packing.unpack."""
  cpw = _CPW[word_bits][bits]
  x = jnp.moveaxis(jnp.asarray(words).astype(jnp.uint32), axis, -1)
  nw = x.shape[-1]
  out = jnp.zeros(x.shape[:-1] + (nw * cpw,), jnp.uint32)
  for j in range(cpw):
    out = out.at[..., _slot_source(nw, cpw, stride, j)].set((x >> (j * bits)) & ((1 << bits) - 1))
  return jnp.moveaxis(out.astype(dtype), -1, axis)


def decode_attention(q, k, v, valid, sm_scale=None):
  """Reference decode attention in float32.

  q [B, Hq, D]; k, v [B, H, T, D]; valid bool[B, T]. Query head i uses kv-head
  i // (Hq // H). Rows with no valid position give zeros.
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
  """Reference of decode_attention.decode_attention: dequantize the cache, then attend."""
  k, v, valid = kv.dequantize(jnp.float32)
  return decode_attention(q, k, v, valid, sm_scale)


def decode_attention_bf16(q, k, v, lengths, sm_scale=None):
  """Reference of decode_attention.decode_attention_bf16."""
  valid = jnp.arange(k.shape[2])[None, :] < jnp.asarray(lengths)[:, None]
  return decode_attention(q, k, v, valid, sm_scale)


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
