"""KV caches behind one interface, used by `Attention` one layer at a time:

    o_BTHD, cache = cache.extend(q_BTHD, k_BTKD, v_BTKD, positions_BT)

The new tokens' keys/values (already rotated) join the cache and the queries attend,
causally, to everything it holds. `cache.nbytes` is the bytes it really holds.

  DenseKVCache         bf16 keys/values, preallocated capacity.
  QuantizedKVCache     pallas_kernels.QuantizedKV: packed low-bit codes + 16-bit outlier
                       channels + full-precision window/sinks. Prefill quantizes the prompt;
                       each decode step appends into the window (whole groups are flushed)
                       and the decode-attention kernel reads the packed cache.
  TeacherForcedQuantKV a whole sequence at once, with every query seeing exactly the keys
                       and values a streaming QuantizedKVCache would hold at its position
                       (quantized groups, full-precision window and sinks): fast perplexity.
  OutlierStats         no cache: records max |k| and |v| per (kv-head, channel) for calibration.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.kv import quant as pk
from pallas_kernels.decode_attention import decode_attention
from moejax.config import KVCacheConfig
from moejax.model.attention import causal_mask, gqa_attention


def kv_quant_config(cfg: KVCacheConfig, bits: int | None = None,
                    outlier_fraction: float | None = None) -> "pk.KVQuantConfig":
  """The pallas_kernels quantizer settings for a (possibly overridden) cache config."""
  return pk.KVQuantConfig(
      bits=cfg.bits if bits is None else bits, group_size=cfg.group_size,
      outlier_fraction=cfg.outlier_fraction if outlier_fraction is None else outlier_fraction,
      residual_window=cfg.residual_window, sink_tokens=cfg.sink_tokens, key_axis=cfg.key_axis,
      value_axis=cfg.value_axis, meta_dtype=cfg.meta_dtype)


def _bhtd(x_BTKD):
  return jnp.swapaxes(x_BTKD, 1, 2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DenseKVCache:
  """bf16 (or any dtype) cache; all sequences of the batch share one length."""
  k_BSKD: jax.Array
  v_BSKD: jax.Array
  length: jax.Array  # int32 scalar: tokens written so far

  @classmethod
  def create(cls, batch: int, capacity: int, num_kv_heads: int, head_dim: int,
             dtype=jnp.bfloat16) -> "DenseKVCache":
    shape = (batch, capacity, num_kv_heads, head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))

  def extend(self, q_BTHD, k_BTKD, v_BTKD, positions_BT):
    start = (0, self.length, 0, 0)
    k = jax.lax.dynamic_update_slice(self.k_BSKD, k_BTKD.astype(self.k_BSKD.dtype), start)
    v = jax.lax.dynamic_update_slice(self.v_BSKD, v_BTKD.astype(self.v_BSKD.dtype), start)
    new = DenseKVCache(k, v, self.length + k_BTKD.shape[1])
    key_pos_S = jnp.arange(k.shape[1])
    mask_BTS = (key_pos_S[None, None, :] <= positions_BT[..., None]) & (key_pos_S < new.length)
    o = gqa_attention(q_BTHD, k.astype(q_BTHD.dtype), v.astype(q_BTHD.dtype), mask_BTS)
    return o, new

  @property
  def nbytes(self) -> int:
    return int(self.k_BSKD.nbytes + self.v_BSKD.nbytes + self.length.nbytes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedKVCache:
  """A pallas_kernels.QuantizedKV for one layer, plus the outlier channels to use.

  extend() with T > 1 tokens is a prefill of an empty cache: the prompt attends to itself in
  full precision (as it would in any serving system), then is quantized. With T == 1 it is
  a decode step: append (flushing whole groups) and run decode attention on the packed cache.
  """
  kv: "pk.QuantizedKV"
  # No calibrated channels: the prefill picks its own outlier channels.
  outliers_from_prefill: bool = dataclasses.field(default=False, metadata=dict(static=True))

  @classmethod
  def create(cls, qcfg: "pk.KVQuantConfig", batch: int, capacity: int, num_kv_heads: int,
             head_dim: int, k_outlier_idx=None, v_outlier_idx=None) -> "QuantizedKVCache":
    kv = pk.empty_kv(qcfg, batch, num_kv_heads, head_dim, capacity,
                     k_outlier_idx=k_outlier_idx, v_outlier_idx=v_outlier_idx)
    return cls(kv, outliers_from_prefill=k_outlier_idx is None)

  def extend(self, q_BTHD, k_BTKD, v_BTKD, positions_BT):
    T = q_BTHD.shape[1]
    if T > 1:
      o = gqa_attention(q_BTHD, k_BTKD, v_BTKD, causal_mask(T))
      own = self.outliers_from_prefill
      kv = pk.quantize_kv(_bhtd(k_BTKD), _bhtd(v_BTKD), self.kv.config,
                          max_len=self.kv.layout.max_len,
                          k_outlier_idx=None if own else self.kv.k_outlier_idx,
                          v_outlier_idx=None if own else self.kv.v_outlier_idx)
      return o, QuantizedKVCache(kv, self.outliers_from_prefill)
    kv = self.kv.append(k_BTKD[:, 0], v_BTKD[:, 0])
    o_BHD = decode_attention(q_BTHD[:, 0], kv)
    return o_BHD[:, None].astype(q_BTHD.dtype), QuantizedKVCache(kv, self.outliers_from_prefill)

  @property
  def nbytes(self) -> int:
    return self.kv.nbytes


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TeacherForcedQuantKV:
  """Whole-sequence attention that sees, at each query position t, the cache a streaming
  decode would hold after appending token t: positions [S, S + nq(t+1)) dequantized from
  their groups, sinks and the window in the cache's full-precision dtype.

  Quantization is per group of G tokens (keys) or per token (values), so a token's
  dequantized value does not depend on when its group was flushed; quantizing the whole
  sequence once (window 0) gives every group's final value.
  """
  k_outlier_idx: jax.Array  # int32 [B, Hkv, n_out] or [Hkv, n_out]
  v_outlier_idx: jax.Array
  qcfg: "pk.KVQuantConfig" = dataclasses.field(metadata=dict(static=True))

  def extend(self, q_BTHD, k_BTKD, v_BTKD, positions_BT):
    B, T, Hkv, D = k_BTKD.shape
    c = self.qcfg
    all_groups = dataclasses.replace(c, residual_window=0)
    k = _bhtd(k_BTKD)
    v = _bhtd(v_BTKD)
    full = pk.quantize_kv(k, v, all_groups, max_len=T, k_outlier_idx=self.k_outlier_idx,
                          v_outlier_idx=self.v_outlier_idx)
    kq, vq, _ = full.dequantize(jnp.float32)
    fp = jnp.dtype(c.dtype)
    kf, vf = k.astype(fp).astype(jnp.float32), v.astype(fp).astype(jnp.float32)
    # nq(L) quantized tokens after position S when the cache holds L = t + 1 tokens.
    layout = pk.KVLayout(c, D, T)
    nq_T = layout.num_quantized(jnp.arange(1, T + 1, dtype=jnp.int32))
    s_pos = jnp.arange(T)
    quantized_TS = (s_pos[None, :] >= c.sink_tokens) & (s_pos[None, :] < c.sink_tokens + nq_T[:, None])
    H = q_BTHD.shape[2]
    q = q_BTHD.astype(jnp.float32).reshape(B, T, Hkv, H // Hkv, D)
    scale = D ** -0.5
    s_q = jnp.einsum("btkgd,bksd->bkgts", q, kq) * scale
    s_f = jnp.einsum("btkgd,bksd->bkgts", q, kf) * scale
    scores = jnp.where(quantized_TS, s_q, s_f)
    scores = jnp.where(causal_mask(T)[:, None, None], scores, -1e30)
    p = jax.nn.softmax(scores, axis=-1)
    o = (jnp.einsum("bkgts,bksd->btkgd", jnp.where(quantized_TS, p, 0.0), vq)
         + jnp.einsum("bkgts,bksd->btkgd", jnp.where(quantized_TS, 0.0, p), vf))
    return o.reshape(B, T, H, D).astype(q_BTHD.dtype), self


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class OutlierStats:
  """Calibration pass: plain causal attention, recording max |k|, |v| per (head, channel)."""
  kmax_KD: jax.Array
  vmax_KD: jax.Array

  @classmethod
  def create(cls, num_kv_heads: int, head_dim: int) -> "OutlierStats":
    z = jnp.zeros((num_kv_heads, head_dim), jnp.float32)
    return cls(z, z)

  def extend(self, q_BTHD, k_BTKD, v_BTKD, positions_BT):
    o = gqa_attention(q_BTHD, k_BTKD, v_BTKD, causal_mask(q_BTHD.shape[1]))
    kmax = jnp.maximum(self.kmax_KD, jnp.abs(k_BTKD.astype(jnp.float32)).max(axis=(0, 1)))
    vmax = jnp.maximum(self.vmax_KD, jnp.abs(v_BTKD.astype(jnp.float32)).max(axis=(0, 1)))
    return o, OutlierStats(kmax, vmax)
