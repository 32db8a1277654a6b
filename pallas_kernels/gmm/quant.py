"""Weight-only quantized expert weights (int8, packed int4) for the grouped matmul.

Symmetric quantization: w[e, i, o] ~= code[e, i, o] * scale[e, i // group_size, o],
codes in [-127, 127] (8 bits) or [-7, 7] (4 bits), float32 scales.

Layouts:
  bits=8: codes int8 [E, I, O].
  bits=4: codes uint8 [E, I/2, O], packed along I in split halves: byte (i, o) holds
    code(i) + 8 in bits 0-3 and code(i + I/2) + 8 in bits 4-7 (lowest bits first).
    Two halves rather than neighbouring rows, so that the kernel unpacks a tile with
    one shift and no interleave.
  scales float32 [E, Q, O]: Q = I // group_size, or Q = 1 for per-output-channel
    scales (group_size None).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class QuantizedExpertWeights:
  """A pytree: packed integer codes + scales of expert weights [E, I, O] (see module doc)."""
  codes: jax.Array
  scales: jax.Array
  bits: int
  group_size: int | None

  @property
  def shape(self) -> tuple[int, int, int]:
    """(E, I, O) of the dequantized weights."""
    e, ic, o = self.codes.shape
    return (e, ic * 2 if self.bits == 4 else ic, o)

  @property
  def nbytes(self) -> int:
    """Bytes held: codes plus scales."""
    return int(self.codes.size * self.codes.dtype.itemsize
               + self.scales.size * self.scales.dtype.itemsize)


jax.tree_util.register_dataclass(
    QuantizedExpertWeights, data_fields=["codes", "scales"], meta_fields=["bits", "group_size"])


def _check(w_EIO, bits, group_size):
  if bits not in (4, 8):
    raise ValueError(f"bits must be 4 or 8, got {bits!r}")
  if getattr(w_EIO, "ndim", None) != 3:
    raise ValueError(f"w_EIO must be [E, I, O], got shape {getattr(w_EIO, 'shape', None)}")
  i = w_EIO.shape[1]
  if bits == 4 and i % 2:
    raise ValueError(f"int4 packs I in two halves: I must be even, got I={i}")
  if group_size is not None:
    if not isinstance(group_size, int) or group_size < 1:
      raise ValueError(f"group_size must be a positive int or None, got {group_size!r}")
    span = i // 2 if bits == 4 else i
    if span % group_size:
      raise ValueError(
          f"group_size={group_size} must divide {'I/2' if bits == 4 else 'I'}={span}")


def quantize_expert_weights(w_EIO, bits: int = 8, group_size: int | None = None
                            ) -> QuantizedExpertWeights:
  """Quantize expert weights [E, I, O] to int8 / packed int4 codes + float32 scales."""
  _check(w_EIO, bits, group_size)
  e, i, o = w_EIO.shape
  gs = i if group_size is None else group_size
  qmax = 127 if bits == 8 else 7
  w = w_EIO.astype(jnp.float32).reshape(e, i // gs, gs, o)
  amax_EQO = jnp.max(jnp.abs(w), axis=2)
  scales_EQO = jnp.where(amax_EQO > 0, amax_EQO / qmax, 1.0)
  codes = jnp.clip(jnp.round(w / scales_EQO[:, :, None, :]), -qmax, qmax).astype(jnp.int32)
  codes_EIO = codes.reshape(e, i, o)
  if bits == 8:
    packed = codes_EIO.astype(jnp.int8)
  else:
    u = (codes_EIO + 8).astype(jnp.uint32)
    packed = (u[:, : i // 2] | (u[:, i // 2:] << 4)).astype(jnp.uint8)
  return QuantizedExpertWeights(packed, scales_EQO, bits, group_size)


def unpack_codes(q: QuantizedExpertWeights) -> jax.Array:
  """Signed integer codes int8 [E, I, O]."""
  if q.bits == 8:
    return q.codes
  u = q.codes.astype(jnp.int32)
  lo, hi = (u & 0xF) - 8, ((u >> 4) & 0xF) - 8
  return jnp.concatenate([lo, hi], axis=1).astype(jnp.int8)


def dequantize_expert_weights(q: QuantizedExpertWeights, dtype=jnp.float32) -> jax.Array:
  """Float weights [E, I, O] in ``dtype`` (plain jnp; the product is formed in f32)."""
  codes_EIO = unpack_codes(q)
  e, i, o = codes_EIO.shape
  n_q = q.scales.shape[1]  # Q = 1 (per channel) or I // group_size
  w = codes_EIO.astype(jnp.float32).reshape(e, n_q, i // n_q, o) * (
      q.scales.astype(jnp.float32)[:, :, None, :])
  return w.reshape(e, i, o).astype(dtype)
