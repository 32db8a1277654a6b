"""KV caches for generation, one interface:

    cache = cache.append(k_BTKD, v_BTKD)   # tokens at positions [length, length + T)
    o_BTHD = cache.attend(q_BTHD, positions_BT)   # causal over everything in the cache
    cache.nbytes                            # bytes the cache holds

All sequences in a batch share one length (generation pads prompts on the left).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.model.attention import gqa_attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DenseKVCache:
  """bf16 (or any dtype) cache with preallocated capacity S."""
  k_BSKD: jax.Array
  v_BSKD: jax.Array
  length: jax.Array  # int32 scalar: tokens written so far

  @classmethod
  def create(cls, batch: int, capacity: int, num_kv_heads: int, head_dim: int,
             dtype=jnp.bfloat16) -> "DenseKVCache":
    shape = (batch, capacity, num_kv_heads, head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))

  def append(self, k_BTKD, v_BTKD) -> "DenseKVCache":
    start = (0, self.length, 0, 0)
    k = jax.lax.dynamic_update_slice(self.k_BSKD, k_BTKD.astype(self.k_BSKD.dtype), start)
    v = jax.lax.dynamic_update_slice(self.v_BSKD, v_BTKD.astype(self.v_BSKD.dtype), start)
    return DenseKVCache(k, v, self.length + k_BTKD.shape[1])

  def attend(self, q_BTHD, positions_BT):
    S = self.k_BSKD.shape[1]
    key_pos_S = jnp.arange(S)
    mask_BTS = (key_pos_S[None, None, :] <= positions_BT[..., None]) & (key_pos_S < self.length)
    return gqa_attention(q_BTHD, self.k_BSKD.astype(q_BTHD.dtype),
                         self.v_BSKD.astype(q_BTHD.dtype), mask_BTS)

  @property
  def nbytes(self) -> int:
    return int(self.k_BSKD.nbytes + self.v_BSKD.nbytes + self.length.nbytes)
