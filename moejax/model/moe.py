"""Mixture-of-Experts feed-forward layer: float32 router, routed SwiGLU experts, optional
shared experts, load-balancing statistics (routing and statistics: routing.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import chex
import jax.numpy as jnp
from flax import nnx

from moejax.config import MoEConfig
from moejax.model import routing
from moejax.model.experts import expert_ffn
from moejax.model.layers import SwiGLU, normal_init

if TYPE_CHECKING:   # type only: parallel imports the model, not the reverse
  from moejax.parallel.dispatch import ExpertParallel


class RouterBias(nnx.Variable):
  """Per-expert selection bias for aux-loss-free balancing; updated outside the optimizer."""


class MoE(nnx.Module):
  """ep: None routes the whole batch on one device; an ExpertParallel routes each device's
  tokens and exchanges them over its mesh (parallel/dispatch.py). Static, not a parameter."""

  def __init__(self, d_model: int, cfg: MoEConfig, *, rngs: nnx.Rngs, std: float, dtype,
               param_dtype, ep: ExpertParallel | None = None):
    E, F = cfg.num_experts, cfg.expert_hidden
    init = normal_init(std)
    self.cfg = cfg
    self.ep = ep
    self.router_DE = nnx.Param(init(rngs.params(), (d_model, E), jnp.float32))
    self.w_gate_EDF = nnx.Param(init(rngs.params(), (E, d_model, F), param_dtype))
    self.w_up_EDF = nnx.Param(init(rngs.params(), (E, d_model, F), param_dtype))
    self.w_down_EFD = nnx.Param(init(rngs.params(), (E, F, d_model), param_dtype))
    self.bias_E = RouterBias(jnp.zeros((E,), jnp.float32)) if cfg.bias_balancing else None
    shared_hidden = (cfg.shared_expert_hidden or F) * cfg.num_shared_experts
    self.shared = SwiGLU(d_model, shared_hidden, rngs=rngs, std=std, dtype=dtype,
                         param_dtype=param_dtype) if cfg.num_shared_experts else None
    self.dtype = dtype

  def __call__(self, x_BTD):
    """Returns (y_BTD, stats): stats holds aux losses and per-expert load counts
    (routing.load_stats)."""
    chex.assert_rank(x_BTD, 3)
    B, T, D = x_BTD.shape
    x_TD = x_BTD.reshape(B * T, D)
    c = lambda p: p[...].astype(self.dtype)
    weights = c(self.w_gate_EDF), c(self.w_up_EDF), c(self.w_down_EFD)
    bias_E = None if self.bias_E is None else self.bias_E[...]
    if self.ep is not None:
      y_TD, stats = self.ep(self.cfg, x_TD, self.router_DE[...], bias_E, *weights)
    else:
      r = routing.route_tokens(self.cfg, x_TD, self.router_DE[...], bias_E)
      # Dropless: a token picks an expert at most once, so T slots per expert always suffice.
      cap = routing.expert_capacity(self.cfg, B * T) or B * T
      y_TD = expert_ffn(self.cfg.expert_impl, x_TD, r.expert_TK, r.weight_TK, r.keep_TK,
                        *weights, capacity=cap)
      stats = routing.load_stats(routing.stat_sums(r), B * T)
    if self.shared is not None:
      y_TD = y_TD + self.shared(x_TD)
    return y_TD.reshape(B, T, D).astype(x_BTD.dtype), stats
