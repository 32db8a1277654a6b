"""Mixture-of-Experts feed-forward layer: float32 router, routed SwiGLU experts, optional
shared experts, load-balancing statistics (routing and statistics: routing.py).

Routed expert weights, by inference.expert_bits:
  16    w_gate_EDF, w_up_EDF, w_down_EFD (param_dtype; the training layout).
  8 | 4 w_gate_up_{codes,scales}: gate and up fused to [E, D, 2F] (gate first), and
        w_down_{codes,scales} [E, F, D], each the codes and scales of a
        pallas_kernels.QuantizedExpertWeights (whose layout the names leave to it).

remat_experts (train.remat=experts, training forward only): the backward recomputes the
routed experts' FFN instead of storing its [rows, D] / [rows, F] intermediates. On one
device that is a jax.checkpoint around expert_ffn. Expert-parallel, routing, exchanges and
experts are one shard_map: it is checkpointed whole, saving the exchanges' outputs, so the
backward recomputes the routing (one [T, E] matmul) and the experts, not the all_to_alls.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import (QuantizedExpertWeights, dequantize_expert_weights,
                            quantize_expert_weights)

from moejax.config import InferenceConfig, MoEConfig
from moejax.model import routing
from moejax.model.experts import expert_ffn, quantized_expert_ffn
from moejax.model.layers import SwiGLU, normal_init

if TYPE_CHECKING:   # type only: parallel imports the model, not the reverse
  from moejax.parallel.dispatch import ExpertParallel


def _save_exchanges(prim, *_, **__) -> bool:
  """jax.checkpoint policy of the expert-parallel remat: keep only what crossed devices."""
  return prim.name in ("all_to_all", "ragged_all_to_all")


class RouterBias(nnx.Variable):
  """Per-expert selection bias for aux-loss-free balancing; updated outside the optimizer."""


class QuantizedWeight(nnx.Param):
  """Codes or scales of int8 / int4 expert weights. A Param, so that nnx.state(model,
  nnx.Param), checkpoints and restore_params carry them; never trained (`moejax train`
  refuses inference.expert_bits != 16)."""


FLOAT_EXPERT_NAMES = ("w_gate_EDF", "w_up_EDF", "w_down_EFD")
QUANTIZED_EXPERT_NAMES = ("w_gate_up_codes", "w_gate_up_scales", "w_down_codes", "w_down_scales")


def quantize_fused_experts(w_gate_up_ED2F, w_down_EFD, bits: int, group_size: int
                           ) -> tuple[QuantizedExpertWeights, QuantizedExpertWeights]:
  """One layer's float experts, gate|up fused, -> their QuantizedExpertWeights; group_size 0:
  one scale per output channel."""
  return (quantize_expert_weights(w_gate_up_ED2F, bits, group_size or None),
          quantize_expert_weights(w_down_EFD, bits, group_size or None))


# One compiled program per layer shape (eager, each of its ops would be a dispatch and a
# float32 temporary of the layer's size).
_quantize_layer = jax.jit(quantize_fused_experts, static_argnums=(2, 3))


def quantize_experts(w_gate_EDF, w_up_EDF, w_down_EFD, bits: int, group_size: int
                     ) -> tuple[QuantizedExpertWeights, QuantizedExpertWeights]:
  """quantize_fused_experts of the training layout (gate first in the fused columns)."""
  return quantize_fused_experts(jnp.concatenate([w_gate_EDF, w_up_EDF], axis=2), w_down_EFD,
                                bits, group_size)


def dequantize_experts(w_gate_up: QuantizedExpertWeights, w_down: QuantizedExpertWeights,
                       dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The inverse layout of quantize_experts: (w_gate_EDF, w_up_EDF, w_down_EFD) in dtype."""
  w_gate_EDF, w_up_EDF = jnp.split(dequantize_expert_weights(w_gate_up, dtype), 2, axis=2)
  return w_gate_EDF, w_up_EDF, dequantize_expert_weights(w_down, dtype)


class MoE(nnx.Module):
  """ep: None routes the whole batch on one device; an ExpertParallel routes each device's
  tokens and exchanges them over its mesh (parallel/dispatch.py). Static, not a parameter.
  inference.expert_bits 8 | 4: quantized experts (module doc), one device only."""

  def __init__(self, d_model: int, cfg: MoEConfig, *, rngs: nnx.Rngs, std: float, dtype,
               param_dtype, ep: ExpertParallel | None = None,
               inference: InferenceConfig = InferenceConfig()):
    E, F = cfg.num_experts, cfg.expert_hidden
    init = normal_init(std)
    self.cfg = cfg
    self.ep = ep
    self.expert_bits = inference.expert_bits
    self.expert_group_size = inference.expert_group_size
    self.router_DE = nnx.Param(init(rngs.params(), (d_model, E), jnp.float32))
    if self.expert_bits == 16:
      self.w_gate_EDF = nnx.Param(init(rngs.params(), (E, d_model, F), param_dtype))
      self.w_up_EDF = nnx.Param(init(rngs.params(), (E, d_model, F), param_dtype))
      self.w_down_EFD = nnx.Param(init(rngs.params(), (E, F, d_model), param_dtype))
    else:
      if ep is not None:
        raise ValueError(f"inference.expert_bits={self.expert_bits}: quantized experts run on "
                         "one device only, not expert-parallel (use mesh.expert=1 or 16 bits)")
      # Drawn and quantized here, this layer only: a quantized model is never whole in float.
      gate_up, down = _quantize_layer(
          init(rngs.params(), (E, d_model, 2 * F), param_dtype),
          init(rngs.params(), (E, F, d_model), param_dtype), self.expert_bits,
          self.expert_group_size)
      self.w_gate_up_codes, self.w_gate_up_scales = (QuantizedWeight(gate_up.codes),
                                                     QuantizedWeight(gate_up.scales))
      self.w_down_codes, self.w_down_scales = (QuantizedWeight(down.codes),
                                               QuantizedWeight(down.scales))
    self.bias_E = RouterBias(jnp.zeros((E,), jnp.float32)) if cfg.bias_balancing else None
    shared_hidden = (cfg.shared_expert_hidden or F) * cfg.num_shared_experts
    self.shared = SwiGLU(d_model, shared_hidden, rngs=rngs, std=std, dtype=dtype,
                         param_dtype=param_dtype) if cfg.num_shared_experts else None
    if cfg.shared_expert_gate:   # only when configured: other models keep their keys
      self.shared_gate_D = nnx.Param(init(rngs.params(), (d_model,), param_dtype))
    self.dtype = dtype

  def __call__(self, x_BTD, remat_experts: bool = False):
    """Returns (y_BTD, stats): stats holds aux losses and per-expert load counts
    (routing.load_stats). remat_experts: see the module doc."""
    chex.assert_rank(x_BTD, 3)
    B, T, D = x_BTD.shape
    x_TD = x_BTD.reshape(B * T, D)
    if self.ep is not None:
      c = lambda p: p[...].astype(self.dtype)
      weights = c(self.w_gate_EDF), c(self.w_up_EDF), c(self.w_down_EFD)
      bias_E = None if self.bias_E is None else self.bias_E[...]
      ep = functools.partial(self.ep, self.cfg)
      if remat_experts:
        ep = jax.checkpoint(ep, policy=_save_exchanges)
      y_TD, stats = ep(x_TD, self.router_DE[...], bias_E, *weights)
    else:
      r = self.route(x_TD)
      # Dropless: a token picks an expert at most once, so T slots per expert always suffice.
      cap = routing.expert_capacity(self.cfg, B * T) or B * T
      y_TD = self.experts(x_TD, r, cap, remat=remat_experts)
      stats = routing.load_stats(routing.stat_sums(r), B * T)
    shared_TD = self.shared_out(x_TD)
    if shared_TD is not None:
      y_TD = y_TD + shared_TD
    return y_TD.reshape(B, T, D).astype(x_BTD.dtype), stats

  # The parts of __call__ (one device), public for callers that run them apart (expert
  # offload, inference/offload.py): route, then experts, plus the shared experts.
  def route(self, x_TD) -> routing.Routing:
    bias_E = None if self.bias_E is None else self.bias_E[...]
    return routing.route_tokens(self.cfg, x_TD, self.router_DE[...], bias_E)

  def shared_out(self, x_TD):
    """The shared experts' (gated) output, or None without shared experts."""
    if self.shared is None:
      return None
    shared_TD = self.shared(x_TD)
    if self.cfg.shared_expert_gate:
      gate_T = jax.nn.sigmoid(x_TD @ self.shared_gate_D[...].astype(x_TD.dtype))
      shared_TD = gate_T[:, None] * shared_TD
    return shared_TD

  def experts(self, x_TD, r: routing.Routing, capacity: int, remat: bool = False):
    """The routed experts' weighted sum for the routing r: [T, D]. remat: recomputed in the
    backward from its inputs (float experts)."""
    args = (self.cfg.expert_impl, x_TD, r.expert_TK, r.weight_TK, r.keep_TK)
    if self.expert_bits == 16:
      c = lambda p: p[...].astype(self.dtype)
      # Fused gate|up only where the weights are cast (copied) anyway: see experts.py.
      fuse = self.w_gate_EDF[...].dtype != jnp.dtype(self.dtype)
      ffn = functools.partial(expert_ffn, capacity=capacity, fuse_gate_up=fuse)
      return (jax.checkpoint(ffn, static_argnums=0) if remat else ffn)(
          *args, c(self.w_gate_EDF), c(self.w_up_EDF), c(self.w_down_EFD))
    q = lambda codes, scales: QuantizedExpertWeights(
        codes[...], scales[...], self.expert_bits, self.expert_group_size or None)
    return quantized_expert_ffn(*args, q(self.w_gate_up_codes, self.w_gate_up_scales),
                                q(self.w_down_codes, self.w_down_scales), capacity=capacity)
