"""Asymmetric low-bit KV-cache quantization with 16-bit outlier channels.

One ``QuantizedKV`` holds the keys and values of one attention layer for ``B``
sequences and ``N`` kv-heads (head dim ``A``), with a fixed token capacity ``max_len`` (static
shapes: it lives inside ``jax.jit`` and is appended to one token per step).

Token positions ``0 .. L-1`` of a sequence of length ``L`` are stored in three
regions::

    [0, sink)              sink tokens, full precision (``sink = sink_tokens``)
    [sink, sink + nq)      quantized, ``nq = floor(max(L - sink - R, 0) / gs) * gs``
    [sink + nq, L)         residual window, full precision (R to R + gs - 1 tokens)

``R = residual_window`` (a multiple of ``gs = group_size``). A decode step writes
the new token into the window; when the window reaches ``R + gs`` tokens its
oldest ``gs`` are quantized as one group ("flush"). So ``nq`` is a function of
``L`` alone, every quantized group spans exactly ``gs`` tokens (per-channel key
statistics never come from fewer), and appending tokens one at a time gives the
same arrays as quantizing the whole prefix at once.

Quantization (asymmetric, min/max): for each group, ``zero = min`` rounded down
and ``scale = (max - zero) / (2**bits - 1)`` rounded up to the metadata dtype,
``code = clip(round((x - zero) / scale), 0, 2**bits - 1)`` and ``x ~ code * scale
+ zero``; the error is at most ``scale / 2`` for every element inside the group's
range. ``axis="channel"`` (keys by default, as KIVI) gives each channel its own
scale over a group of ``gs`` consecutive tokens; ``axis="token"`` (values by
default) gives each token its own scale over ``gs`` consecutive (low-bit)
channels.

Outlier channels: ``n_out = num_outliers(A)`` channels per (sequence, kv-head),
separately for keys and values, chosen by largest max-|x| (over the prefill or
calibration data; ``select_outlier_channels``) or passed in. They are stored in
full precision (bf16/fp16), have no low-bit codes and take no part in any
low-bit statistics. The remaining ``D_low = A - n_out`` channels, in ascending
order, form the low-bit tensor (padded with zero channels to ``D_pad``, a
multiple of 16, so kernel rows stay 64-byte aligned).

Arrays (``Cq`` = quantized capacity in tokens, ``cpw`` = codes per uint16 word:
8, 5, 4, 2 for 2, 3, 4, 8 bits):

* ``k_codes``, ``v_codes``: ``uint16[B, N, Cq // cpw, D_pad]`` - packed along the
  token axis with stride 64 (``packing`` module, ``word_bits=16``): word row
  ``64*b + r`` slot ``j`` holds token ``b*64*cpw + 64*j + r``; one word per
  channel. A ``[64, D_pad]`` tile of words (one TMA box) thus holds ``cpw`` slots of
  64 consecutive tokens each, the row count of one warpgroup MMA operand. 16-bit
  words let the decode kernels turn the words of two neighbouring channels (one
  32-bit register) into two fp16 values with three instructions.
* ``k_scale``, ``k_zero`` (and ``v_*``): metadata dtype; ``[B, N, Cq // gs, D_pad]``
  for ``axis="channel"``, ``[B, N, ceil(D_low / gs), Cq]`` for ``axis="token"``
  (token-minor, so a tile's metadata is one contiguous copy).
* ``k_outliers``, ``v_outliers``: ``[B, N, n_out, Cq]`` full-precision values of the
  outlier channels of quantized tokens (token-minor, likewise).
* ``k_outlier_idx``, ``v_outlier_idx``: ``int32[B, N, n_out]``, ascending.
* ``k_fp``, ``v_fp``: ``[B, N, sink + R + gs, A]`` full precision: slots ``[0, sink)``
  are the sinks, slot ``sink + (p - sink) % (R + gs)`` holds window position ``p`` (a ring).
* ``lengths``: ``int32[B]``.

``nbytes`` is the sum of these arrays' bytes; ``bits_per_element`` divides it
by the ``2 * B * N * max_len * A`` key and value elements the object can hold.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv import packing
from pallas_kernels.kv.groups import fp_dtype as _fp_dtype, meta_dtype as _meta_dtype, quantize_groups
from pallas_kernels.kv.layout import (  # noqa: F401  (re-exported: the quantizer's public names)
    PACK_STRIDE, WORD_BITS, KVLayout, KVQuantConfig, channel_positions, fp_slot_positions,
    from_split, low_channel_index)

_KV_FIELDS = ("k_codes", "k_scale", "k_zero", "k_outliers", "k_outlier_idx", "k_fp",
              "v_codes", "v_scale", "v_zero", "v_outliers", "v_outlier_idx", "v_fp",
              "lengths")


@functools.partial(jax.tree_util.register_dataclass, data_fields=list(_KV_FIELDS),
                   meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
  """Quantized keys and values of one layer (see the module docstring for layout)."""
  k_codes: jax.Array
  k_scale: jax.Array
  k_zero: jax.Array
  k_outliers: jax.Array
  k_outlier_idx: jax.Array
  k_fp: jax.Array
  v_codes: jax.Array
  v_scale: jax.Array
  v_zero: jax.Array
  v_outliers: jax.Array
  v_outlier_idx: jax.Array
  v_fp: jax.Array
  lengths: jax.Array
  layout: KVLayout

  @property
  def config(self) -> KVQuantConfig:
    return self.layout.config

  @property
  def batch(self) -> int:
    return self.k_fp.shape[0]

  @property
  def num_heads(self) -> int:
    return self.k_fp.shape[1]

  def arrays(self) -> dict[str, jax.Array]:
    return {f: getattr(self, f) for f in _KV_FIELDS}

  @property
  def nbytes(self) -> int:
    """Exact bytes held: the sum of every array's bytes (metadata, indices, window, lengths)."""
    return int(sum(a.size * a.dtype.itemsize for a in self.arrays().values()))

  def nbytes_by_part(self) -> dict[str, int]:
    """Bytes per part: codes, metadata (scales+zeros), outliers (values+indices),
    full_precision (sinks+window ring), lengths."""
    a = {f: int(x.size * x.dtype.itemsize) for f, x in self.arrays().items()}
    return {
        "codes": a["k_codes"] + a["v_codes"],
        "metadata": a["k_scale"] + a["k_zero"] + a["v_scale"] + a["v_zero"],
        "outliers": a["k_outliers"] + a["v_outliers"] + a["k_outlier_idx"] + a["v_outlier_idx"],
        "full_precision": a["k_fp"] + a["v_fp"],
        "lengths": a["lengths"],
    }

  @property
  def bits_per_element(self) -> float:
    """Effective bits per key/value element at full capacity, everything included."""
    n = 2 * self.batch * self.num_heads * self.layout.max_len * self.layout.head_dim
    return 8.0 * self.nbytes / n

  @property
  def quantized_bits_per_element(self) -> float:
    """Bits per element of the quantized region alone (codes + metadata + outliers +
    their indices), i.e. excluding the fixed full-precision sink/window buffers."""
    p = self.nbytes_by_part()
    n = 2 * self.batch * self.num_heads * max(self.layout.cq, 1) * self.layout.head_dim
    return 8.0 * (p["codes"] + p["metadata"] + p["outliers"]) / n

  def num_quantized(self) -> jax.Array:
    return self.layout.num_quantized(self.lengths)

  def dequantize(self, dtype=jnp.float32):
    """Returns ``(k, v, valid)``: ``[B, N, max_len, A]`` in position order and
    ``bool[B, max_len]`` marking positions ``< lengths``."""
    return _dequantize(self, dtype)

  def append(self, k_new: jax.Array, v_new: jax.Array) -> "QuantizedKV":
    """Appends one token per sequence (``k_new``, ``v_new``: ``[B, N, A]``); see ``append_kv``."""
    return append_kv(self, k_new, v_new)


# --- outlier channels -------------------------------------------------------------------


def select_outlier_channels(x: jax.Array, n_out: int, lengths: jax.Array | None = None) -> jax.Array:
  """Top-``n_out`` channels by max |x| over valid tokens.

  x: ``[B, N, S, A]``; lengths: ``int32[B]`` (default: all S valid).
  Returns ``int32[B, N, n_out]``, ascending. For calibration shared by all
  sequences, pass calibration activations with B = 1 and broadcast the result.
  """
  b, h, t, d = x.shape
  if not 0 <= n_out < d:
    raise ValueError(f"n_out must be in [0, {d}), got {n_out}")
  mag = jnp.abs(x.astype(jnp.float32))
  if lengths is not None:
    valid = jnp.arange(t)[None, :] < lengths[:, None]
    mag = jnp.where(valid[:, None, :, None], mag, 0.0)
  score = jnp.max(mag, axis=2)                     # [B, N, A]
  idx = jax.lax.top_k(score, n_out)[1] if n_out else jnp.zeros((b, h, 0), jnp.int32)
  return jnp.sort(idx, axis=-1).astype(jnp.int32)


def _check_outlier_idx(idx, b, h, n_out, d, what):
  if idx is None:
    return None
  idx = jnp.asarray(idx)
  if idx.ndim == 2:
    idx = jnp.broadcast_to(idx[None], (b,) + idx.shape)
  if idx.shape != (b, h, n_out):
    raise ValueError(f"{what} must have shape [N, n_out] or [B, N, n_out] = "
                     f"{(b, h, n_out)} for this config, got {tuple(idx.shape)}")
  if not isinstance(idx, jax.core.Tracer):
    a = np.asarray(idx)
    if a.size and (a.min() < 0 or a.max() >= d):
      raise ValueError(f"{what} holds channels outside [0, {d})")
    if a.size and n_out > 1 and not (np.diff(np.sort(a, -1), axis=-1) > 0).all():
      raise ValueError(f"{what} holds a repeated channel")
  return jnp.sort(idx, axis=-1).astype(jnp.int32)


# --- quantizing a token range -----------------------------------------------------------


def _quantize_tokens(x, out_idx, layout: KVLayout, axis: str, valid_tok):
  """Quantizes ``x [B, N, S, A]`` (S a multiple of gs) -> (codes_unpacked [B,N,S,D_pad],
  scale, zero, outliers [B,H,T,n_out]); tokens where ``valid_tok [B, T]`` is False
  are stored as zeros."""
  cfg = layout.config
  b, h, t, d = x.shape
  g = cfg.group_size
  x = x.astype(jnp.float32)
  lo_idx = low_channel_index(out_idx, d)                                  # [B,H,Dl]
  x_lo = jnp.take_along_axis(x, lo_idx[:, :, None, :], axis=3)             # [B,H,T,Dl]
  x_out = jnp.take_along_axis(x, out_idx[:, :, None, :], axis=3)           # [B,H,T,n]
  md = _meta_dtype(cfg)
  dl, dp = layout.d_low, layout.d_pad
  if axis == "channel":
    xg = x_lo.reshape(b, h, t // g, g, dl)
    codes, scale, zero = quantize_groups(xg, jnp.ones(xg.shape, bool), cfg.bits, md, 3)
    codes = codes.reshape(b, h, t, dl)
    pad = [(0, 0)] * 3 + [(0, dp - dl)]
    scale, zero = jnp.pad(scale, pad), jnp.pad(zero, pad)
    meta_valid = valid_tok[:, ::g][:, None, :, None]
  else:
    ng = layout.n_groups_tok
    xp = jnp.pad(x_lo, [(0, 0)] * 3 + [(0, ng * g - dl)])
    msk = jnp.arange(ng * g) < dl
    xg = xp.reshape(b, h, t, ng, g)
    codes, scale, zero = quantize_groups(xg, jnp.broadcast_to(msk.reshape(ng, g), xg.shape),
                                         cfg.bits, md, 4)
    codes = codes.reshape(b, h, t, ng * g)[..., :dl]
    meta_valid = valid_tok[:, None, :, None]
  codes = jnp.pad(codes, [(0, 0)] * 3 + [(0, dp - dl)])
  vt = valid_tok[:, None, :, None]
  codes = jnp.where(vt, codes, jnp.uint32(0))
  zero_m = jnp.zeros((), md)
  scale = jnp.where(meta_valid, scale, zero_m)
  zero = jnp.where(meta_valid, zero, zero_m)
  x_out = jnp.where(vt, x_out, 0.0).astype(_fp_dtype(cfg))
  return codes, scale, zero, x_out


def quantize_kv(k: jax.Array, v: jax.Array, config: KVQuantConfig, *,
                max_len: int | None = None, lengths: jax.Array | None = None,
                k_outlier_idx: jax.Array | None = None,
                v_outlier_idx: jax.Array | None = None) -> QuantizedKV:
  """Quantizes a prefill into a cache of capacity ``max_len`` (jit-able).

  k, v: ``[B, N, S, A]`` (S <= max_len; positions >= lengths are ignored).
  lengths: ``int32[B]`` valid tokens per sequence (default T).
  k_outlier_idx, v_outlier_idx: ``int[N, n_out]`` or ``int[B, N, n_out]`` channels
    to keep in 16 bits (e.g. from calibration); default: chosen from this prefill
    by ``select_outlier_channels``.
  """
  if k.ndim != 4 or k.shape != v.shape:
    raise ValueError(f"k and v must both be [B, N, S, A], got {k.shape} and {v.shape}")
  b, h, t, d = k.shape
  max_len = t if max_len is None else int(max_len)
  if t > max_len:
    raise ValueError(f"prefill of {t} tokens exceeds max_len {max_len}")
  layout = KVLayout(config, d, max_len)
  n_out = layout.n_out
  if lengths is None:
    lengths = jnp.full((b,), t, jnp.int32)
  lengths = jnp.asarray(lengths, jnp.int32)
  if lengths.shape != (b,):
    raise ValueError(f"lengths must be [B] = [{b}], got {lengths.shape}")
  k_idx = _check_outlier_idx(k_outlier_idx, b, h, n_out, d, "k_outlier_idx")
  v_idx = _check_outlier_idx(v_outlier_idx, b, h, n_out, d, "v_outlier_idx")
  if k_idx is None:
    k_idx = select_outlier_channels(k, n_out, lengths)
  if v_idx is None:
    v_idx = select_outlier_channels(v, n_out, lengths)

  s, cq = config.sink_tokens, layout.cq
  nq = layout.num_quantized(lengths)
  valid_tok = jnp.arange(cq)[None, :] < nq[:, None]

  def region(x):
    xr = x[:, :, s:s + cq]
    return jnp.pad(xr, [(0, 0), (0, 0), (0, cq - xr.shape[2]), (0, 0)])

  pos, held = fp_slot_positions(layout, lengths)
  fd = _fp_dtype(config)

  def fp_buffer(x):
    if t == 0:
      return jnp.zeros((b, h, layout.fp_slots, d), fd)
    g = jnp.take_along_axis(x, jnp.clip(pos, 0, t - 1)[:, None, :, None], axis=2)
    return jnp.where(held[:, None, :, None], g, 0).astype(fd)

  fields = {}
  for name, x, idx, axis in (("k", k, k_idx, config.key_axis), ("v", v, v_idx, config.value_axis)):
    # Inputs are rounded to the cache dtype first, as the decode path (which
    # quantizes from the full-precision window) sees them.
    codes, scale, zero, outl = _quantize_tokens(region(x.astype(fd)), idx, layout, axis, valid_tok)
    fields[f"{name}_codes"] = packing.pack_jnp(codes, config.bits, axis=2, stride=PACK_STRIDE,
                                               word_bits=WORD_BITS)
    tm = axis == "token"
    fields[f"{name}_scale"] = jnp.swapaxes(scale, 2, 3) if tm else scale
    fields[f"{name}_zero"] = jnp.swapaxes(zero, 2, 3) if tm else zero
    fields[f"{name}_outliers"] = jnp.swapaxes(outl, 2, 3)
    fields[f"{name}_outlier_idx"] = idx
    fields[f"{name}_fp"] = fp_buffer(x)
  return QuantizedKV(lengths=lengths, layout=layout, **fields)


def empty_kv(config: KVQuantConfig, batch: int, num_heads: int, head_dim: int, max_len: int,
             k_outlier_idx: jax.Array | None = None,
             v_outlier_idx: jax.Array | None = None) -> QuantizedKV:
  """An empty cache (all lengths 0); outlier channels default to the last n_out."""
  layout = KVLayout(config, head_dim, max_len)
  n_out = layout.n_out
  default = jnp.broadcast_to(jnp.arange(head_dim - n_out, head_dim, dtype=jnp.int32),
                             (batch, num_heads, n_out))
  k_idx = _check_outlier_idx(k_outlier_idx, batch, num_heads, n_out, head_dim, "k_outlier_idx")
  v_idx = _check_outlier_idx(v_outlier_idx, batch, num_heads, n_out, head_dim, "v_outlier_idx")
  z = jnp.zeros((batch, num_heads, 0, head_dim), _fp_dtype(config))
  return quantize_kv(z, z, config, max_len=max_len, lengths=jnp.zeros((batch,), jnp.int32),
                     k_outlier_idx=default if k_idx is None else k_idx,
                     v_outlier_idx=default if v_idx is None else v_idx)


def kv_bits_per_element(config: KVQuantConfig, head_dim: int, context: int) -> dict[str, float]:
  """Effective bits per element of a cache of capacity ``context`` (from shapes alone).

  Returns ``{"total": ..., "quantized": ...}``: everything held, and the quantized
  region alone (codes + metadata + outliers + indices, no sink/window buffers).
  """
  cache = jax.eval_shape(lambda: empty_kv(config, 1, 1, head_dim, context))
  return {"total": cache.bits_per_element, "quantized": cache.quantized_bits_per_element}


# --- decode-time append -----------------------------------------------------------------


def append_kv(cache: QuantizedKV, k_new: jax.Array, v_new: jax.Array) -> QuantizedKV:
  """Appends one token to every sequence (jit-able, static shapes).

  k_new, v_new: ``[B, N, A]``. The token goes to its sink slot or window ring
  slot; if the window then holds ``R + G`` tokens, its oldest ``G`` tokens are
  quantized as one group (outlier channels from the cache's indices). Appending
  to a full cache (``lengths == max_len``) cannot raise under jit: the token is
  dropped and the cache is returned unchanged.
  """
  layout = cache.layout
  cfg = layout.config
  b, h = cache.batch, cache.num_heads
  d = layout.head_dim
  if k_new.shape != (b, h, d) or v_new.shape != (b, h, d):
    raise ValueError(f"k_new and v_new must be [B, N, A] = {(b, h, d)}, "
                     f"got {k_new.shape} and {v_new.shape}")
  s, g, wc, cq = cfg.sink_tokens, cfg.group_size, layout.ring, layout.cq
  L = cache.lengths
  slot = jnp.where(L < s, L, s + jnp.mod(L - s, wc))
  bi = jnp.arange(b)
  fd = _fp_dtype(cfg)
  room = (L < layout.max_len)[:, None, None]            # a full cache keeps its window
  k_fp = cache.k_fp.at[bi, :, slot, :].set(jnp.where(room, k_new.astype(fd), cache.k_fp[bi, :, slot, :]))
  v_fp = cache.v_fp.at[bi, :, slot, :].set(jnp.where(room, v_new.astype(fd), cache.v_fp[bi, :, slot, :]))
  L1 = jnp.minimum(L + 1, layout.max_len)
  nq0, nq1 = layout.num_quantized(L), layout.num_quantized(L1)
  flush = nq1 > nq0                                        # [B]
  new = dict(cache.arrays(), k_fp=k_fp, v_fp=v_fp, lengths=L1)
  if cq == 0:
    return QuantizedKV(layout=layout, **new)
  g0 = jnp.minimum(nq0, cq - g)                            # first quantized index of the group
  rs = s + jnp.mod(g0, wc)                                 # its ring slot (contiguous: wc % g == 0)
  ones = jnp.ones((b, g), bool)
  for name, axis in (("k", cfg.key_axis), ("v", cfg.value_axis)):
    fp = new[f"{name}_fp"]
    tile = jax.vmap(lambda x, r: jax.lax.dynamic_slice_in_dim(x, r, g, axis=1))(fp, rs)
    codes, scale, zero, outl = _quantize_tokens(tile, new[f"{name}_outlier_idx"], layout, axis, ones)
    fl = flush[:, None, None, None]
    # metadata rows
    if axis == "channel":
      row = g0 // g
      old = new[f"{name}_scale"][bi, :, row, :]
      new[f"{name}_scale"] = new[f"{name}_scale"].at[bi, :, row, :].set(
          jnp.where(flush[:, None, None], scale[:, :, 0, :], old))
      old = new[f"{name}_zero"][bi, :, row, :]
      new[f"{name}_zero"] = new[f"{name}_zero"].at[bi, :, row, :].set(
          jnp.where(flush[:, None, None], zero[:, :, 0, :], old))
    else:
      for f, val in (("scale", scale), ("zero", zero)):
        new[f"{name}_{f}"] = _update_cols(new[f"{name}_{f}"], val, g0, fl)
    new[f"{name}_outliers"] = _update_cols(new[f"{name}_outliers"], outl, g0, fl)
    # packed codes: each chunk of min(G, 64) tokens lies in one slot of one 64-word tile
    words = new[f"{name}_codes"]
    p, n = layout.pack_tokens, min(g, PACK_STRIDE)
    wdt = words.dtype
    for c in range(g // n):
      tq = g0 + c * n
      row0 = (tq // p) * PACK_STRIDE + tq % PACK_STRIDE
      shift = ((tq % p) // PACK_STRIDE * cfg.bits).astype(wdt)
      chunk = codes[:, :, c * n:(c + 1) * n, :].astype(wdt)
      add = jnp.where(fl, chunk << shift[:, None, None, None], wdt.type(0))
      old = jax.vmap(lambda w, r: jax.lax.dynamic_slice_in_dim(w, r, n, axis=1))(words, row0)
      words = jax.vmap(lambda w, u, r: jax.lax.dynamic_update_slice_in_dim(w, u, r, axis=1))(
          words, old | add, row0)
    new[f"{name}_codes"] = words
  return QuantizedKV(layout=layout, **new)


def _update_cols(arr, val, start, flush):
  """Token-minor ``arr [B, N, n, Cq]``: arr[b, :, :, start[b]:start[b]+t] = val[b]^T
  where flush[b] ([B,1,1,1]); ``val [B, N, t, n]``."""
  val = jnp.swapaxes(val, 2, 3)
  t = val.shape[3]
  old = jax.vmap(lambda a, r: jax.lax.dynamic_slice_in_dim(a, r, t, axis=2))(arr, start)
  upd = jnp.where(flush, val.astype(arr.dtype), old)
  return jax.vmap(lambda a, u, r: jax.lax.dynamic_update_slice_in_dim(a, u, r, axis=2))(arr, upd, start)


# --- dequantize -------------------------------------------------------------------------


def dequantize_region(codes_packed, scale, zero, outliers, outlier_idx, layout: KVLayout, axis: str):
  """Quantized region -> float32 ``[B, N, Cq, A]`` in original channel order."""
  cfg = layout.config
  if axis == "token":                      # stored token-minor: back to [B, N, Cq, n]
    scale, zero = jnp.swapaxes(scale, 2, 3), jnp.swapaxes(zero, 2, 3)
  outliers = jnp.swapaxes(outliers, 2, 3)
  codes = packing.unpack_jnp(codes_packed, cfg.bits, axis=2, stride=PACK_STRIDE, word_bits=WORD_BITS,
                             dtype=jnp.uint32).astype(jnp.float32)
  dp = codes.shape[-1]
  g = cfg.group_size
  s32, z32 = scale.astype(jnp.float32), zero.astype(jnp.float32)
  if axis == "channel":
    s_e = jnp.repeat(s32, g, axis=2)
    z_e = jnp.repeat(z32, g, axis=2)
  else:
    s_e = jnp.repeat(s32, g, axis=3)[..., :dp]
    z_e = jnp.repeat(z32, g, axis=3)[..., :dp]
    s_e = jnp.pad(s_e, [(0, 0)] * 3 + [(0, dp - s_e.shape[3])])
    z_e = jnp.pad(z_e, [(0, 0)] * 3 + [(0, dp - z_e.shape[3])])
  x_lo = (codes * s_e + z_e)[..., :layout.d_low]
  pos = channel_positions(outlier_idx, layout.head_dim)[:, :, None, :]
  return from_split(x_lo, outliers.astype(jnp.float32), pos, layout.n_out)


def _dequantize(cache: QuantizedKV, dtype):
  layout = cache.layout
  cfg = layout.config
  s, wc, cq, n = cfg.sink_tokens, layout.ring, layout.cq, layout.max_len
  L = cache.lengths
  nq = layout.num_quantized(L)
  p = jnp.arange(n)
  res = []
  for name, axis in (("k", cfg.key_axis), ("v", cfg.value_axis)):
    q = dequantize_region(getattr(cache, f"{name}_codes"), getattr(cache, f"{name}_scale"),
                          getattr(cache, f"{name}_zero"), getattr(cache, f"{name}_outliers"),
                          getattr(cache, f"{name}_outlier_idx"), layout, axis)
    qpos = jnp.clip(p - s, 0, max(cq - 1, 0))
    from_q = q[:, :, qpos, :] if cq else jnp.zeros(q.shape[:2] + (n, q.shape[3]), jnp.float32)
    fp = getattr(cache, f"{name}_fp").astype(jnp.float32)
    fslot = jnp.where(p < s, p, s + jnp.mod(p - s, wc))
    from_fp = fp[:, :, fslot, :]
    in_q = (p[None, :] >= s) & (p[None, :] < s + nq[:, None])
    x = jnp.where(in_q[:, None, :, None], from_q, from_fp)
    res.append(x.astype(dtype))
  valid = p[None, :] < L[:, None]
  res = [jnp.where(valid[:, None, :, None], x, 0) for x in res]
  return res[0], res[1], valid
