"""Group-wise asymmetric min/max quantization: the zero-point rounded down and the scale up
in the metadata dtype, so every element of a group is within scale / 2 of its code."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def meta_dtype(cfg):
  return jnp.dtype(cfg.meta_dtype)


def fp_dtype(cfg):
  return jnp.dtype(cfg.dtype)


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _round_directed(x, dtype, up: bool):
  """Rounds float32 ``x`` to ``dtype``: the nearest representable value >= x (up) or <= x."""
  fmax = float(jnp.finfo(dtype).max)
  x = jnp.clip(x, -fmax, fmax)
  y = x.astype(dtype)
  yf = y.astype(jnp.float32)
  need = (yf < x) if up else (yf > x)
  ut = _UINT[jnp.dtype(dtype).itemsize]
  nbits = 8 * jnp.dtype(dtype).itemsize
  u = jax.lax.bitcast_convert_type(y, ut)
  sign = (u >> (nbits - 1)).astype(bool)
  mag = u & ut((1 << (nbits - 1)) - 1)
  # One step toward +inf (up) or -inf (down) in the sign-magnitude encoding.
  away_from_zero = (~sign) if up else sign
  stepped = jnp.where(mag == 0,
                      ut(1) if up else ut((1 << (nbits - 1)) | 1),
                      jnp.where(away_from_zero, u + ut(1), u - ut(1)))
  stepped = jax.lax.bitcast_convert_type(stepped.astype(ut), dtype)
  stepped = jnp.where(jnp.abs(stepped.astype(jnp.float32)) <= fmax, stepped, y)
  return jnp.where(need, stepped, y)


def quantize_groups(x, mask, bits: int, meta_dtype, reduce_axis: int):
  """Min/max asymmetric quantization of ``x`` (float32) in groups along ``reduce_axis``.

  ``mask`` marks the elements that take part in the statistics (others get code 0).
  Returns ``codes`` (uint32, shape of x), ``scale`` and ``zero`` (meta dtype, with
  ``reduce_axis`` removed).
  """
  qmax = (1 << bits) - 1
  big = jnp.float32(np.finfo(np.float32).max)
  mn = jnp.min(jnp.where(mask, x, big), axis=reduce_axis)
  mx = jnp.max(jnp.where(mask, x, -big), axis=reduce_axis)
  empty = ~jnp.any(mask, axis=reduce_axis)
  mn = jnp.where(empty, 0.0, mn)
  mx = jnp.where(empty, 0.0, mx)
  zero = _round_directed(mn, meta_dtype, up=False)
  scale = _round_directed((mx - zero.astype(jnp.float32)) / qmax, meta_dtype, up=True)
  s = jnp.expand_dims(scale.astype(jnp.float32), reduce_axis)
  z = jnp.expand_dims(zero.astype(jnp.float32), reduce_axis)
  q = jnp.where(s > 0, (x - z) / jnp.where(s > 0, s, 1.0), 0.0)
  codes = jnp.clip(jnp.round(q), 0, qmax).astype(jnp.uint32)
  codes = jnp.where(mask, codes, jnp.uint32(0))
  return codes, scale, zero
