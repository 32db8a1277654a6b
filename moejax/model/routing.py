"""Routing in one place: token -> expert choice, combine weights, capacity, load statistics.

Both MoE paths use this module: the single-device layer (moe.py) routes the whole batch as
one group; the expert-parallel dispatch (parallel/dispatch.py) routes each device's tokens
as a group. Statistics are built from additive per-group sums (`stat_sums`), so the
expert-parallel path adds its devices' sums and applies the same `load_stats`.

Shapes: T tokens, E experts, K slots per token (top_k, or max_k for the elastic modes), C
capacity slots per expert. Everything here runs in float32.

Elastic modes (top_p, entropy) choose a number of experts per token at run time: K = max_k
slots stay static for jit and the unused ones are masked (selected = keep = False, weight
0), which experts.py sorts past the real groups, so no expert weights are read for them.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy.special import entr

from moejax.config import ELASTIC_ROUTING, MoEConfig


class Routing(NamedTuple):
  expert_TK: jax.Array    # int32 expert index per slot
  weight_TK: jax.Array    # float32 combine weight per slot (0 where not used)
  keep_TK: jax.Array      # bool: slot selected and not dropped by capacity
  probs_TE: jax.Array     # float32 full softmax over experts (for the aux loss)
  logits_TE: jax.Array    # float32 router logits (for the z-loss)
  selected_TK: jax.Array  # bool: slot selected by the router (before capacity)


def route(logits_TE: jax.Array, *, mode: str, top_k: int, renormalize: bool,
          top_p: float = 1.0, max_k: int = 1, min_k: int = 1, entropy_threshold: float = 0.5,
          bias_E: jax.Array | None = None, capacity: int | None = None) -> Routing:
  """Chooses experts per token.

  mode: 'softmax_topk' (softmax over all E, keep the top k; Mixtral),
        'topk_softmax' (top k logits, softmax over those k),
        'top_p' (softmax; take experts by descending prob until cumulative >= top_p, <= max_k),
        'entropy' (softmax; the top entropy_k experts, see `entropy_k`: min_k for a
          confident router, up to max_k for an uncertain one).
  Weights: the chosen experts' softmax probs, divided by their sum when renormalize (every
    mode but topk_softmax, whose weights sum to 1 already); unused slots weigh 0. So a
    softmax_topk model decoded by top_p / entropy weights its experts as it was trained.
  bias_E: auxiliary-loss-free balancing bias, added for *selection only*; the weights come
    from the unbiased probabilities.
  capacity: slots per expert; assignments beyond it are dropped (top-1 choices get
    priority over top-2 choices, earlier tokens over later ones). None: dropless.
  """
  logits_TE = logits_TE.astype(jnp.float32)
  probs_TE = jax.nn.softmax(logits_TE, axis=-1)
  select_scores = logits_TE if mode == "topk_softmax" else probs_TE
  if bias_E is not None:
    select_scores = select_scores + bias_E.astype(jnp.float32)
  k = max_k if mode in ELASTIC_ROUTING else top_k
  _, expert_TK = jax.lax.top_k(select_scores, k)
  expert_TK = expert_TK.astype(jnp.int32)
  chosen_probs_TK = jnp.take_along_axis(probs_TE, expert_TK, axis=-1)

  if mode == "topk_softmax":
    chosen_logits_TK = jnp.take_along_axis(logits_TE, expert_TK, axis=-1)
    weight_TK = jax.nn.softmax(chosen_logits_TK, axis=-1)
    selected_TK = jnp.ones_like(expert_TK, dtype=bool)
  elif mode == "softmax_topk":
    weight_TK = chosen_probs_TK
    selected_TK = jnp.ones_like(expert_TK, dtype=bool)
  elif mode == "top_p":
    # Slot j is used when the mass of the slots before it is still < p: so the first slot
    # always is, and the token stops as soon as it has reached p.
    mass_before_TK = jnp.cumsum(chosen_probs_TK, axis=-1) - chosen_probs_TK
    selected_TK = mass_before_TK < top_p
    weight_TK = jnp.where(selected_TK, chosen_probs_TK, 0.0)
  elif mode == "entropy":
    k_T = entropy_k(probs_TE, min_k, max_k, entropy_threshold)
    selected_TK = jnp.arange(k, dtype=jnp.int32) < k_T[:, None]
    weight_TK = jnp.where(selected_TK, chosen_probs_TK, 0.0)
  else:
    raise ValueError(f"unknown routing mode {mode!r}")
  if renormalize and mode != "topk_softmax":
    weight_TK = weight_TK / jnp.maximum(weight_TK.sum(-1, keepdims=True), 1e-9)

  keep_TK = selected_TK
  if capacity is not None:
    keep_TK = selected_TK & (position_in_expert(expert_TK, selected_TK, probs_TE.shape[-1])
                             < capacity)
  weight_TK = jnp.where(keep_TK, weight_TK, 0.0)
  return Routing(expert_TK, weight_TK, keep_TK, probs_TE, logits_TE, selected_TK)


def normalized_entropy(probs_TE: jax.Array) -> jax.Array:
  """H(p) / log E per token, in [0, 1]: 0 for a one-hot router, 1 for a uniform one. [T]"""
  E = probs_TE.shape[-1]
  if E == 1:
    return jnp.zeros(probs_TE.shape[:-1], jnp.float32)
  return jnp.clip(entr(probs_TE.astype(jnp.float32)).sum(-1) / math.log(E), 0.0, 1.0)


def entropy_k(probs_TE: jax.Array, min_k: int, max_k: int, threshold: float) -> jax.Array:
  """Experts per token of entropy routing: with h = normalized_entropy and t = threshold,

      k = min_k + ceil((max_k - min_k) * max(h - t, 0) / (1 - t))

  min_k while h <= t, then one more expert per (1 - t) / (max_k - min_k) of h, max_k for a
  uniform router (h = 1). With max_k = min_k + 1 it is a switch at t. int32 [T]."""
  h_T = normalized_entropy(probs_TE)
  frac_T = jnp.clip((h_T - threshold) / (1.0 - threshold), 0.0, 1.0)
  return min_k + jnp.ceil(frac_T * (max_k - min_k)).astype(jnp.int32)


def slots_per_token(cfg: MoEConfig) -> int:
  """K: the expert slots a token may fill (top_k; max_k for the elastic modes)."""
  return cfg.max_k if cfg.routing in ELASTIC_ROUTING else cfg.top_k


def capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
  """Slots per expert. Dropless (cf=0): every token could pick one expert, so T slots."""
  if capacity_factor <= 0:
    return num_tokens
  return max(1, min(num_tokens, math.ceil(capacity_factor * num_tokens * top_k / num_experts)))


def expert_capacity(cfg: MoEConfig, num_tokens: int) -> int | None:
  """C for a routing group of `num_tokens` tokens; None when dropless (capacity_factor 0)."""
  if cfg.capacity_factor <= 0:
    return None
  return capacity(num_tokens, slots_per_token(cfg), cfg.num_experts, cfg.capacity_factor)


def route_tokens(cfg: MoEConfig, x_TD: jax.Array, router_DE: jax.Array,
                 bias_E: jax.Array | None = None) -> Routing:
  """The MoE layer's routing of one group of tokens, capacity counted from that group."""
  logits_TE = x_TD.astype(jnp.float32) @ router_DE.astype(jnp.float32)
  return route(logits_TE, mode=cfg.routing, top_k=cfg.top_k, renormalize=cfg.renormalize,
               top_p=cfg.top_p, max_k=cfg.max_k, min_k=cfg.min_k,
               entropy_threshold=cfg.entropy_threshold, bias_E=bias_E,
               capacity=expert_capacity(cfg, x_TD.shape[0]))


def position_in_expert(expert_TK: jax.Array, selected_TK: jax.Array, num_experts: int) -> jax.Array:
  """Arrival order of each (token, slot) at its expert, slot-major: [T, K] int32."""
  T, K = expert_TK.shape
  onehot_KTE = jax.nn.one_hot(expert_TK.T, num_experts, dtype=jnp.int32) * selected_TK.T[..., None]
  flat = onehot_KTE.reshape(K * T, num_experts)
  pos = jnp.cumsum(flat, axis=0) - flat                       # tokens before this one
  pos_KT = jnp.sum(pos * flat, axis=-1).reshape(K, T)
  return pos_KT.T.astype(jnp.int32)


def expert_counts(expert_TK: jax.Array, mask_TK: jax.Array, num_experts: int) -> jax.Array:
  """Number of (token, slot) assignments per expert: [E] float32."""
  onehot = jax.nn.one_hot(expert_TK, num_experts, dtype=jnp.float32) * mask_TK[..., None]
  return onehot.sum(axis=(0, 1))


def switch_loss(counts_E: jax.Array, mean_probs_E: jax.Array) -> jax.Array:
  """E * sum_e f_e * P_e: f_e = share of assignments, P_e = mean router probability.

  Equals 1.0 for a perfectly uniform router; grows as the load concentrates.
  """
  f_E = counts_E / jnp.maximum(counts_E.sum(), 1.0)
  return counts_E.shape[-1] * jnp.sum(f_E * mean_probs_E)


def load_balancing_loss(probs_TE: jax.Array, expert_TK: jax.Array, selected_TK: jax.Array) -> jax.Array:
  """The Switch loss of one group of tokens."""
  counts_E = expert_counts(expert_TK, selected_TK, probs_TE.shape[-1])
  return switch_loss(counts_E, probs_TE.mean(axis=0))


def router_z_loss(logits_TE: jax.Array) -> jax.Array:
  """mean over tokens of logsumexp(logits)^2 (ST-MoE): keeps router logits small."""
  return jnp.mean(jax.nn.logsumexp(logits_TE, axis=-1) ** 2)


def stat_sums(r: Routing) -> dict[str, jax.Array]:
  """This group's share of the load statistics: sums over its tokens, so groups (devices)
  combine by adding them."""
  E = r.probs_TE.shape[-1]
  return {"routed_E": expert_counts(r.expert_TK, r.selected_TK, E),  # before capacity
          "load_E": expert_counts(r.expert_TK, r.keep_TK, E),        # after capacity
          "probs_E": r.probs_TE.sum(axis=0),
          "z": jnp.sum(jax.nn.logsumexp(r.logits_TE, axis=-1) ** 2)}


def load_stats(sums: dict[str, jax.Array], num_tokens: int) -> dict[str, jax.Array]:
  """The MoE layer's statistics from the stat_sums over all its `num_tokens` tokens:
  aux_loss (Switch), z_loss, load_E, routed_E, dropped_frac, experts_per_token."""
  routed_E, load_E = sums["routed_E"], sums["load_E"]
  selected = routed_E.sum()
  return {"aux_loss": switch_loss(routed_E, sums["probs_E"] / num_tokens),
          "z_loss": sums["z"] / num_tokens,
          "load_E": load_E,
          "routed_E": routed_E,
          "dropped_frac": 1.0 - load_E.sum() / jnp.maximum(selected, 1.0),
          "experts_per_token": selected / num_tokens}


def bias_update(bias_E: jax.Array, counts_E: jax.Array, rate: float) -> jax.Array:
  """DeepSeek-V3 aux-loss-free step: raise the bias of under-loaded experts, lower over-loaded."""
  return bias_E + rate * jnp.sign(counts_E.mean() - counts_E)
