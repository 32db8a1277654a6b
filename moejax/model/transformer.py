"""Decoder-only MoE transformer (Flax NNX).

The training forward (caches None) follows train.remat and model.scan_layers, see
`Transformer.train_layers`; the decode forward (caches given) is the plain loop over blocks.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import Config, ModelConfig, is_moe_layer
from moejax.model import routing
from moejax.model.attention import Attention
from moejax.model.layers import (RMSNorm, RopeScaling, SwiGLU, dtype_of, lm_head_logits,
                                 normal_init)
from moejax.model.moe import MoE

if TYPE_CHECKING:   # type only: parallel imports the model, not the reverse
  from moejax.parallel.dispatch import ExpertParallel


def rope_scaling_of(m: ModelConfig) -> RopeScaling | None:
  if m.rope_scaling == "none":
    return None
  return RopeScaling(m.rope_scaling, m.rope_factor, m.rope_low_freq_factor,
                     m.rope_high_freq_factor, m.rope_original_max_len)


class Block(nnx.Module):
  def __init__(self, cfg: Config, layer: int, *, rngs: nnx.Rngs,
               ep: ExpertParallel | None = None):
    m = cfg.model
    dtype, pdtype = dtype_of(m.dtype), dtype_of(m.param_dtype)
    self.attn_norm = RMSNorm(m.d_model, eps=m.norm_eps, param_dtype=pdtype)
    self.attn = Attention(m.d_model, m.num_heads, m.num_kv_heads, m.head_dim,
                          rope_theta=m.rope_theta, rngs=rngs, std=m.init_std, dtype=dtype,
                          param_dtype=pdtype, qkv_bias=m.qkv_bias, qk_norm=m.qk_norm,
                          clip_qkv=m.clip_qkv, norm_eps=m.norm_eps,
                          rope_scaling=rope_scaling_of(m), implementation=m.attention_impl)
    self.ffn_norm = RMSNorm(m.d_model, eps=m.norm_eps, param_dtype=pdtype)
    self.is_moe = is_moe_layer(cfg, layer)
    if self.is_moe:
      self.ffn = MoE(m.d_model, cfg.moe, rngs=rngs, std=m.init_std, dtype=dtype,
                     param_dtype=pdtype, ep=ep, inference=cfg.inference)
    else:
      self.ffn = SwiGLU(m.d_model, m.ffn_hidden, rngs=rngs, std=m.init_std, dtype=dtype,
                        param_dtype=pdtype)

  def __call__(self, x_BTD, positions_BT, cache=None, remat_experts: bool = False):
    """remat_experts: the MoE layer's routed experts are rematerialized (moe.py)."""
    a, cache = self.attn(self.attn_norm(x_BTD), positions_BT, cache)
    x_BTD = x_BTD + a
    h = self.ffn_norm(x_BTD)
    stats = None
    if self.is_moe:
      f, stats = self.ffn(h, remat_experts)
    else:
      f = self.ffn(h)
    return x_BTD + f, cache, stats


class Transformer(nnx.Module):
  """tokens_BT -> logits_BTV; also returns per-MoE-layer routing stats.

  ep: run the MoE layers expert-parallel over a mesh (parallel.expert_parallel); None: one
  device. Static: the same parameters and checkpoints serve both.
  """

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs, ep: ExpertParallel | None = None):
    m = cfg.model
    self.cfg = cfg
    self.dtype = dtype_of(m.dtype)
    pdtype = dtype_of(m.param_dtype)
    self.embed_VD = nnx.Param(normal_init(m.init_std)(rngs.params(), (m.vocab_size, m.d_model), pdtype))
    self.blocks = nnx.List([Block(cfg, i, rngs=rngs, ep=ep) for i in range(m.num_layers)])
    self.final_norm = RMSNorm(m.d_model, eps=m.norm_eps, param_dtype=pdtype)
    self.lm_head_DV = None if m.tie_embeddings else nnx.Param(
        normal_init(m.init_std)(rngs.params(), (m.d_model, m.vocab_size), pdtype))

  @property
  def moe_layers(self) -> list[int]:
    return [i for i, b in enumerate(self.blocks) if b.is_moe]

  def __call__(self, tokens_BT, positions_BT=None, caches=None):
    """caches: None (training / full sequence) or a list with one KV cache per layer.

    Returns (logits_BTV float32, stats: list of per-MoE-layer dicts, new caches or None).
    """
    chex.assert_rank(tokens_BT, 2)
    chex.assert_type(tokens_BT, int)
    B, T = tokens_BT.shape
    if positions_BT is not None:
      chex.assert_equal_shape([tokens_BT, positions_BT])
    else:
      positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x = self.embed_VD[...][tokens_BT].astype(self.dtype)
    stats, new_caches = [], []
    if caches is None and (self.cfg.model.scan_layers or self.cfg.train.remat != "none"):
      x, stats = self.train_layers(x, positions_BT)
    else:
      for i, block in enumerate(self.blocks):
        x, c, s = block(x, positions_BT, None if caches is None else caches[i])
        new_caches.append(c)
        if s is not None:
          stats.append(s)
    x = self.final_norm(x)
    head = self.embed_VD[...].T if self.lm_head_DV is None else self.lm_head_DV[...]
    logits = lm_head_logits(x, head.astype(self.dtype))
    return logits, stats, (None if caches is None else new_caches)

  def train_layers(self, x_BTD, positions_BT):
    """The blocks' full-sequence forward under train.remat and model.scan_layers.

    scan_layers: each run of consecutive blocks with one structure (graphdef: e.g. the
    moe.first_dense_layers dense blocks, then the MoE blocks) runs as one lax.scan over its
    blocks' states stacked leaf-wise, so the run compiles as one block. The parameters stay
    an nnx.List of Blocks (checkpoints, inference, sharding rules index model.blocks); the
    stack is a copy made in the step, its transpose slices the gradients back per block.
    remat full: each block (the scan body) is a jax.checkpoint; experts: only the MoE
    layers' routed experts are (moe.py). Returns (x_BTD, per-MoE-layer stats).
    """
    remat = self.cfg.train.remat
    groups = (_same_structure_runs(self.blocks) if self.cfg.model.scan_layers
              else [[b] for b in self.blocks])
    stats = []
    for group in groups:
      fn = _block_fn(nnx.graphdef(group[0]), remat, in_scan=len(group) > 1)
      if len(group) == 1:
        x_BTD, s = fn(nnx.state(group[0]), x_BTD, positions_BT)
        if s is not None:
          stats.append(s)
        continue
      stacked = jax.tree.map(lambda *v: jnp.stack(v), *[nnx.state(b) for b in group])
      x_BTD, s_L = jax.lax.scan(lambda x, st: fn(st, x, positions_BT), x_BTD, stacked)
      if s_L is not None:
        stats += [jax.tree.map(lambda a, i=i: a[i], s_L) for i in range(len(group))]
    return x_BTD, stats


def _same_structure_runs(blocks) -> list[list[Block]]:
  """Consecutive blocks grouped while their graphdefs (module structure and static
  attributes) and their state's shapes and dtypes are equal: what one scan body needs."""
  runs: list[list[Block]] = []
  last = None
  for b in blocks:
    graphdef, state = nnx.split(b)
    key = (graphdef, tuple((x.shape, x.dtype) for x in jax.tree.leaves(state)))
    if runs and key == last:
      runs[-1].append(b)
    else:
      runs.append([b])
    last = key
  return runs


def _block_fn(graphdef, remat: str, in_scan: bool):
  """(block state, x_BTD, positions_BT) -> (x_BTD, stats or None): one block's training
  forward as a pure function of its state, for jax.checkpoint and lax.scan."""
  def fn(state, x_BTD, positions_BT):
    before = jax.tree.leaves(state)
    block = nnx.merge(graphdef, state)
    y_BTD, _, stats = block(x_BTD, positions_BT, remat_experts=remat == "experts")
    # A Variable written here would be lost with the merged block: refuse, not drop, it.
    after = jax.tree.leaves(nnx.state(block))
    if len(before) != len(after) or any(a is not b for a, b in zip(before, after)):
      raise ValueError("a Block wrote to its state during the forward: model.scan_layers and "
                       "train.remat run each block as a pure function of its state and "
                       "cannot keep the write; train with both off")
    return y_BTD.astype(x_BTD.dtype), stats
  # Inside a scan, CSE across iterations cannot undo the remat: no barrier needed.
  return jax.checkpoint(fn, prevent_cse=not in_scan) if remat == "full" else fn


def count_params(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def active_params(cfg: Config) -> int:
  """Parameters touched per token (routed experts counted top_k times, not E times)."""
  m, e = cfg.model, cfg.moe
  attn = m.d_model * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
  total = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
  for i in range(m.num_layers):
    total += attn
    if is_moe_layer(cfg, i):
      k = routing.slots_per_token(e)
      shared = (e.shared_expert_hidden or e.expert_hidden) * e.num_shared_experts
      total += 3 * m.d_model * (k * e.expert_hidden + shared) + m.d_model * e.num_experts
      total += m.d_model if e.shared_expert_gate else 0
    else:
      total += 3 * m.d_model * m.ffn_hidden
  return total
