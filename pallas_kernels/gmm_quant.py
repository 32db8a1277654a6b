"""Weight-only quantized expert weights (int8, packed int4) for the grouped matmul.

Symmetric quantization: w[e, k, n] ~= code[e, k, n] * scale[e, k // group_size, n],
codes in [-127, 127] (8 bits) or [-7, 7] (4 bits), float32 scales.

Layouts:
  bits=8: codes int8 [E, K, N].
  bits=4: codes uint8 [E, K/2, N], packed along K in split halves: byte (k, n)
    holds code(k) + 8 in bits 0-3 and code(k + K/2) + 8 in bits 4-7 (lowest bits
    first). Two halves rather than neighbouring rows, so that the kernel unpacks
    a tile with one shift and no interleave.
  scales float32 [E, G, N]: G = K // group_size, or G = 1 for per-output-channel
    scales (group_size None).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import reference


@dataclasses.dataclass(frozen=True)
class QuantizedExpertWeights:
  """A pytree: packed integer codes + scales of expert weights [E, K, N] (see module doc)."""
  codes: jax.Array
  scales: jax.Array
  bits: int
  group_size: int | None

  @property
  def shape(self) -> tuple[int, int, int]:
    """(E, K, N) of the dequantized weights."""
    e, kc, n = self.codes.shape
    return (e, kc * 2 if self.bits == 4 else kc, n)

  @property
  def nbytes(self) -> int:
    """Bytes held: codes plus scales."""
    return int(self.codes.size * self.codes.dtype.itemsize
               + self.scales.size * self.scales.dtype.itemsize)


jax.tree_util.register_dataclass(
    QuantizedExpertWeights, data_fields=["codes", "scales"], meta_fields=["bits", "group_size"])


def _check(w_EKN, bits, group_size):
  if bits not in (4, 8):
    raise ValueError(f"bits must be 4 or 8, got {bits!r}")
  if getattr(w_EKN, "ndim", None) != 3:
    raise ValueError(f"w_EKN must be [E, K, N], got shape {getattr(w_EKN, 'shape', None)}")
  k = w_EKN.shape[1]
  if bits == 4 and k % 2:
    raise ValueError(f"int4 packs K in two halves: K must be even, got K={k}")
  if group_size is not None:
    if not isinstance(group_size, int) or group_size < 1:
      raise ValueError(f"group_size must be a positive int or None, got {group_size!r}")
    span = k // 2 if bits == 4 else k
    if span % group_size:
      raise ValueError(
          f"group_size={group_size} must divide {'K/2' if bits == 4 else 'K'}={span}")


def quantize_expert_weights(w_EKN, bits: int = 8, group_size: int | None = None
                            ) -> QuantizedExpertWeights:
  """Quantize expert weights [E, K, N] to int8 / packed int4 codes + float32 scales."""
  _check(w_EKN, bits, group_size)
  e, k, n = w_EKN.shape
  gs = k if group_size is None else group_size
  qmax = 127 if bits == 8 else 7
  w = w_EKN.astype(jnp.float32).reshape(e, k // gs, gs, n)
  amax_EGN = jnp.max(jnp.abs(w), axis=2)
  scale_EGN = jnp.where(amax_EGN > 0, amax_EGN / qmax, 1.0)
  codes = jnp.clip(jnp.round(w / scale_EGN[:, :, None, :]), -qmax, qmax).astype(jnp.int32)
  codes = codes.reshape(e, k, n)
  if bits == 8:
    packed = codes.astype(jnp.int8)
  else:
    u = (codes + 8).astype(jnp.uint32)
    packed = (u[:, : k // 2] | (u[:, k // 2:] << 4)).astype(jnp.uint8)
  return QuantizedExpertWeights(packed, scale_EGN, bits, group_size)


def unpack_codes(q: QuantizedExpertWeights) -> jax.Array:
  """Signed integer codes int8 [E, K, N]."""
  if q.bits == 8:
    return q.codes
  u = q.codes.astype(jnp.int32)
  lo, hi = (u & 0xF) - 8, ((u >> 4) & 0xF) - 8
  return jnp.concatenate([lo, hi], axis=1).astype(jnp.int8)


def dequantize_expert_weights(q: QuantizedExpertWeights, dtype=jnp.float32) -> jax.Array:
  """Float weights [E, K, N] (plain jnp)."""
  w = reference.dequantize_expert_weights(unpack_codes(q), q.scales, q.bits, q.group_size)
  return w.astype(dtype)
