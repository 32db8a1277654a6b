"""Mixture-of-Experts feed-forward layer: float32 router, routed SwiGLU experts, optional
shared experts, load-balancing statistics."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from moejax.config import MoEConfig, capacity as capacity_for
from moejax.model import routing
from moejax.model.experts import expert_ffn
from moejax.model.layers import SwiGLU, normal_init
from moejax.parallel import context as parallel_context


class RouterBias(nnx.Variable):
  """Per-expert selection bias for aux-loss-free balancing; updated outside the optimizer."""


class MoE(nnx.Module):
  def __init__(self, d_model: int, cfg: MoEConfig, *, rngs: nnx.Rngs, std: float, dtype,
               param_dtype):
    E, F = cfg.num_experts, cfg.expert_hidden
    init = normal_init(std)
    self.cfg = cfg
    self.router_DE = nnx.Param(init(rngs.params(), (d_model, E), jnp.float32))
    self.w_gate_EDF = nnx.Param(init(rngs.params(), (E, d_model, F), param_dtype))
    self.w_up_EDF = nnx.Param(init(rngs.params(), (E, d_model, F), param_dtype))
    self.w_down_EFD = nnx.Param(init(rngs.params(), (E, F, d_model), param_dtype))
    self.bias_E = RouterBias(jnp.zeros((E,), jnp.float32)) if cfg.bias_balancing else None
    shared_hidden = (cfg.shared_expert_hidden or F) * cfg.num_shared_experts
    self.shared = SwiGLU(d_model, shared_hidden, rngs=rngs, std=std, dtype=dtype,
                         param_dtype=param_dtype) if cfg.num_shared_experts else None
    self.dtype = dtype

  def slots_per_expert(self, num_tokens: int) -> int | None:
    """Capacity of each expert for `num_tokens` tokens; None when dropless."""
    cfg = self.cfg
    if cfg.capacity_factor <= 0:
      return None
    k = cfg.max_k if cfg.routing == "top_p" else cfg.top_k
    return capacity_for(num_tokens, k, cfg.num_experts, cfg.capacity_factor)

  def route(self, x_TD) -> routing.Routing:
    cfg = self.cfg
    logits_TE = x_TD.astype(jnp.float32) @ self.router_DE[...]
    return routing.route(logits_TE, mode=cfg.routing, top_k=cfg.top_k, renormalize=cfg.renormalize,
                         top_p=cfg.top_p, max_k=cfg.max_k,
                         bias_E=None if self.bias_E is None else self.bias_E[...],
                         capacity=self.slots_per_expert(x_TD.shape[0]))

  def experts(self, x_TD, r: routing.Routing):
    c = lambda p: p[...].astype(self.dtype)
    # Dropless: a token picks an expert at most once, so T slots per expert always suffice.
    cap = self.slots_per_expert(x_TD.shape[0]) or x_TD.shape[0]
    return expert_ffn(self.cfg.expert_impl, x_TD, r.expert_TK, r.weight_TK, r.keep_TK,
                      c(self.w_gate_EDF), c(self.w_up_EDF), c(self.w_down_EFD), capacity=cap)

  def __call__(self, x_BTD):
    """Returns (y_BTD, stats): stats holds aux losses and per-expert load counts."""
    B, T, D = x_BTD.shape
    x_TD = x_BTD.reshape(B * T, D)
    ep = parallel_context.active()
    if ep is not None:  # multi-device mesh: route per device, exchange tokens (parallel/dispatch.py)
      from moejax.parallel.dispatch import moe_experts
      c = lambda p: p[...].astype(self.dtype)
      y_TD, stats = moe_experts(ep.mesh, self.cfg, x_TD, self.router_DE[...],
                                None if self.bias_E is None else self.bias_E[...],
                                c(self.w_gate_EDF), c(self.w_up_EDF), c(self.w_down_EFD),
                                exchange=ep.exchange)
      if self.shared is not None:
        y_TD = y_TD + self.shared(x_TD)
      return y_TD.reshape(B, T, D).astype(x_BTD.dtype), stats
    r = self.route(x_TD)
    y_TD = self.experts(x_TD, r)
    if self.shared is not None:
      y_TD = y_TD + self.shared(x_TD)
    E = self.cfg.num_experts
    selected = r.selected_TK.sum()
    stats = {
        "aux_loss": routing.load_balancing_loss(r.probs_TE, r.expert_TK, r.selected_TK),
        "z_loss": routing.router_z_loss(r.logits_TE),
        "load_E": routing.expert_counts(r.expert_TK, r.keep_TK, E),      # after capacity
        "routed_E": routing.expert_counts(r.expert_TK, r.selected_TK, E),  # before capacity
        "dropped_frac": 1.0 - r.keep_TK.sum() / jnp.maximum(selected, 1),
        "experts_per_token": selected / (B * T),
    }
    return y_TD.reshape(B, T, D).astype(x_BTD.dtype), stats
