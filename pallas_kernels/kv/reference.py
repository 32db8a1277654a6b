"""Plain ``jnp`` packing, loop by loop: the ground truth of ``pallas_kernels.kv.packing``.

Only the tests import this file. Layout: ``pallas_kernels.kv.packing``'s module docstring.
"""
from __future__ import annotations

import jax.numpy as jnp

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
