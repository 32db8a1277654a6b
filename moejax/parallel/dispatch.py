"""Expert-parallel MoE inside jax.shard_map: route locally, exchange tokens, run local experts.

Layout over the mesh ("data", "expert", "model"): tokens are split over data x expert
(every device routes its own T_l tokens), expert weights are split along `expert`
(E_l = E / n_ep experts per device) and replicated along `data`. Exchanges run over the
`expert` axis only, so each data-parallel replica is an independent EP group.

Capacity mode (moe.capacity_factor > 0): per-device capacity C = capacity(T_l, k, E, cf),
counted from the device's *own* tokens. Each device fills an [E, C, D] buffer (a token's
top-1 choice has priority over its top-2, earlier tokens over later, as on one device) and
one `all_to_all` hands every expert its n_ep * C rows. This equals the single-device model
applied to each device's tokens as a separate routing group; it equals the single-device
model on the whole batch exactly when nothing is dropped.

Dropless mode (capacity_factor = 0): assignments are sorted by expert and sent as ragged
chunks (`jax.lax.ragged_all_to_all` on GPU/TPU). XLA:CPU has no ragged all-to-all, so on
CPU (or with exchange="padded") each chunk is padded to the worst case and sent with a
plain `all_to_all`: same results, n_ep times the exchange bytes. The receive buffer is
sized for the worst case either way: n_ep * T_l * min(k, E_l) rows.

The received rows go through `expert_ffn` with the same `expert_impl` (dense | ragged |
blocked | gmm) and come back by the reverse exchange. Load statistics (aux loss, z-loss,
counts, dropped share) are summed over all devices, so they equal the global ones.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from moejax.config import MoEConfig, capacity as capacity_for
from moejax.model import routing
from moejax.model.experts import expert_ffn
from moejax.parallel.mesh import TOKEN_AXES

EXCHANGES = ("auto", "ragged", "padded")
EP = "expert"


def resolve_exchange(exchange: str = "auto") -> str:
  """auto -> ragged where XLA implements ragged-all-to-all (GPU, TPU), else padded.
  MOEJAX_EP_EXCHANGE=ragged|padded overrides auto."""
  exchange = os.environ.get("MOEJAX_EP_EXCHANGE", exchange) if exchange == "auto" else exchange
  if exchange not in EXCHANGES:
    raise ValueError(f"unknown exchange {exchange!r}; choose one of {', '.join(EXCHANGES)}")
  if exchange == "auto":
    return "ragged" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "padded"
  return exchange


# ------------------------------------------------------------- exchanges ---

def padded_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                             recv_sizes, *, axis_name):
  """jax.lax.ragged_all_to_all semantics (one chunk per peer) from a dense all_to_all:
  every chunk is padded to operand's full length N. operand [N, ...], output [M, ...]."""
  N, M = operand.shape[0], output.shape[0]
  rows_N = jnp.arange(N, dtype=jnp.int32)
  src_nN = input_offsets[:, None] + rows_N[None, :]
  chunks = operand.at[src_nN].get(mode="fill", fill_value=0)            # [n, N, ...]
  live_nN = rows_N[None, :] < send_sizes[:, None]
  chunks = jnp.where(live_nN.reshape(live_nN.shape + (1,) * (operand.ndim - 1)), chunks, 0)
  recv = jax.lax.all_to_all(chunks, axis_name, 0, 0)                      # [n src, N, ...]
  dest_off_n = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
  dest_nN = jnp.where(rows_N[None, :] < recv_sizes[:, None], dest_off_n[:, None] + rows_N, M)
  return output.at[dest_nN].set(recv, mode="drop")


def _ragged_a2a(exchange: str):
  if exchange == "ragged":
    return lambda *a, axis_name: jax.lax.ragged_all_to_all(*a, axis_name=axis_name)
  return padded_ragged_all_to_all


def _exclusive_cumsum(x):
  return jnp.cumsum(x) - x


# ---------------------------------------------------------- local experts ---

def _local_experts(impl, x_MD, e_M, valid_M, w_gate, w_up, w_down):
  """Every received row goes to one local expert with weight 1 (combine weights are
  applied on the token's own device)."""
  return expert_ffn(impl, x_MD, e_M[:, None], jnp.ones(e_M.shape + (1,), jnp.float32),
                    valid_M[:, None], w_gate, w_up, w_down, capacity=x_MD.shape[0])


def capacity_exchange(impl, x_TD, r: routing.Routing, w_gate_EDF, w_up_EDF, w_down_EFD, *,
                      num_experts: int, capacity: int, n_ep: int):
  """Per-device [E, C, D] buffers, one all_to_all each way. Local shapes; inside shard_map."""
  T, K = r.expert_TK.shape
  D, E, C = x_TD.shape[1], num_experts, capacity
  El = E // n_ep
  pos_TK = routing.position_in_expert(r.expert_TK, r.keep_TK, E)
  e_TK = jnp.where(r.keep_TK, r.expert_TK, E)                 # E: out of range, dropped
  x_ECD = jnp.zeros((E, C, D), x_TD.dtype).at[e_TK, pos_TK].set(
      jnp.broadcast_to(x_TD[:, None, :], (T, K, D)), mode="drop")
  count_E = routing.expert_counts(r.expert_TK, r.keep_TK, E).astype(jnp.int32)
  # recv[j, e] = rows that device j routed to my local expert e.
  recv_nLCD = jax.lax.all_to_all(x_ECD.reshape(n_ep, El, C, D), EP, 0, 0)
  recv_count_nL = jax.lax.all_to_all(count_E.reshape(n_ep, El), EP, 0, 0)
  x_LnCD = recv_nLCD.transpose(1, 0, 2, 3)
  if impl == "dense":   # the buffers already are the dense impl's [E_l, n*C, D] layout
    x_LMD = x_LnCD.reshape(El, n_ep * C, D)
    h = jax.nn.silu(jnp.einsum("lmd,ldf->lmf", x_LMD, w_gate_EDF)) * jnp.einsum(
        "lmd,ldf->lmf", x_LMD, w_up_EDF)
    y_LnCD = jnp.einsum("lmf,lfd->lmd", h, w_down_EFD).reshape(El, n_ep, C, D)
  else:
    valid_LnC = jnp.arange(C)[None, None, :] < recv_count_nL.T[:, :, None]
    e_LnC = jnp.broadcast_to(jnp.arange(El, dtype=jnp.int32)[:, None, None], (El, n_ep, C))
    y_MD = _local_experts(impl, x_LnCD.reshape(-1, D), e_LnC.reshape(-1), valid_LnC.reshape(-1),
                          w_gate_EDF, w_up_EDF, w_down_EFD)
    y_LnCD = y_MD.reshape(El, n_ep, C, D)
  y_ECD = jax.lax.all_to_all(y_LnCD.transpose(1, 0, 2, 3), EP, 0, 0).reshape(E, C, D)
  y_TKD = y_ECD.at[e_TK, pos_TK].get(mode="fill", fill_value=0)
  return jnp.einsum("tkd,tk->td", y_TKD, r.weight_TK.astype(y_TKD.dtype))


def dropless_exchange(impl, x_TD, r: routing.Routing, w_gate_EDF, w_up_EDF, w_down_EFD, *,
                      num_experts: int, n_ep: int, exchange: str):
  """Assignments sorted by expert, sent as one ragged chunk per peer. Local shapes."""
  T, K = r.expert_TK.shape
  D, E = x_TD.shape[1], num_experts
  El, M = E // n_ep, T * K
  a2a = _ragged_a2a(exchange)
  eid_M = jnp.where(r.keep_TK, r.expert_TK, E).reshape(-1)   # unselected slots sort last
  order_M = jnp.argsort(eid_M, stable=True)
  token_M = order_M // K
  sizes_E = jnp.bincount(eid_M, length=E + 1)[:E].astype(jnp.int32)
  send_n = sizes_E.reshape(n_ep, El).sum(1)
  send_off_n = _exclusive_cumsum(send_n)
  # recv_count[j, e]: rows device j sends to my local expert e; chunks land source-major.
  recv_count_nL = jax.lax.all_to_all(sizes_E.reshape(n_ep, El), EP, 0, 0)
  recv_n = recv_count_nL.sum(1)
  recv_off_n = _exclusive_cumsum(recv_n)
  dest_off_n = jax.lax.all_to_all(recv_off_n, EP, 0, 0, tiled=True)   # where mine land
  R = n_ep * T * min(K, El)                                   # worst case: all come to me
  x_RD = a2a(x_TD[token_M], jnp.zeros((R, D), x_TD.dtype), send_off_n, send_n, dest_off_n,
             recv_n, axis_name=EP)
  seg_R = jnp.searchsorted(jnp.cumsum(recv_count_nL.reshape(-1)), jnp.arange(R), side="right")
  y_RD = _local_experts(impl, x_RD, (seg_R % El).astype(jnp.int32), seg_R < n_ep * El,
                        w_gate_EDF, w_up_EDF, w_down_EFD)
  back_off_n = jax.lax.all_to_all(send_off_n, EP, 0, 0, tiled=True)
  y_MD = a2a(y_RD.astype(x_TD.dtype), jnp.zeros((M, D), x_TD.dtype), recv_off_n, recv_n,
             back_off_n, send_n, axis_name=EP)
  w_M = r.weight_TK.reshape(-1)[order_M]
  y_MD = jnp.where((jnp.arange(M) < sizes_E.sum())[:, None], y_MD * w_M[:, None].astype(
      y_MD.dtype), 0)
  return jnp.zeros_like(x_TD).at[token_M].add(y_MD)


# ------------------------------------------------------------------ layer ---

def local_stat_sums(r: routing.Routing, num_experts: int) -> dict:
  """This device's share of the load statistics: sums over its tokens, [1, ...] each."""
  E = num_experts
  sums = {"routed_E": routing.expert_counts(r.expert_TK, r.selected_TK, E),
          "load_E": routing.expert_counts(r.expert_TK, r.keep_TK, E),
          "probs_E": r.probs_TE.sum(0),
          "z": jnp.sum(jax.nn.logsumexp(r.logits_TE, axis=-1) ** 2)}
  return {k: v[None] for k, v in sums.items()}


def global_stats(sums: dict, num_experts: int, tokens_total: int) -> dict:
  """MoE.__call__'s stats from every device's sums (summed over the leading device axis)."""
  sums = {k: v.sum(0) for k, v in sums.items()}
  routed_E, load_E = sums["routed_E"], sums["load_E"]
  selected, kept = routed_E.sum(), load_E.sum()
  return {
      "aux_loss": num_experts * jnp.sum(routed_E / jnp.maximum(selected, 1.0)
                                        * sums["probs_E"] / tokens_total),
      "z_loss": sums["z"] / tokens_total,
      "load_E": load_E,
      "routed_E": routed_E,
      "dropped_frac": 1.0 - kept / jnp.maximum(selected, 1),
      "experts_per_token": selected / tokens_total,
  }


def moe_experts(mesh: Mesh, cfg: MoEConfig, x_TD, router_DE, bias_E, w_gate_EDF, w_up_EDF,
                w_down_EFD, *, exchange: str = "auto"):
  """The routed part of the MoE layer over `mesh`. x_TD global [T, D] (T divisible by
  data*expert); weights global [E, ...]. -> (y_TD, stats) like the single-device layer."""
  n_ep = mesh.shape[EP]
  n_tok = mesh.shape["data"] * n_ep
  T, E = x_TD.shape[0], cfg.num_experts
  if T % n_tok:
    raise ValueError(f"{T} tokens cannot be split evenly over mesh data*expert={n_tok} devices")
  if E % n_ep or w_gate_EDF.shape[0] != E:
    raise ValueError(f"mesh expert={n_ep} must divide num_experts={E} "
                     f"(weights have {w_gate_EDF.shape[0]} experts)")
  exchange = resolve_exchange(exchange)
  T_l = T // n_tok
  k_slots = cfg.max_k if cfg.routing == "top_p" else cfg.top_k
  cap = capacity_for(T_l, k_slots, E, cfg.capacity_factor) if cfg.capacity_factor > 0 else None
  has_bias = bias_E is not None
  bias_E = bias_E if has_bias else jnp.zeros((E,), jnp.float32)

  def local(x_TD, router_DE, bias_E, w_gate, w_up, w_down):
    logits_TE = x_TD.astype(jnp.float32) @ router_DE
    r = routing.route(logits_TE, mode=cfg.routing, top_k=cfg.top_k, renormalize=cfg.renormalize,
                      top_p=cfg.top_p, max_k=cfg.max_k, bias_E=bias_E if has_bias else None,
                      capacity=cap)
    if cap is not None:
      y_TD = capacity_exchange(cfg.expert_impl, x_TD, r, w_gate, w_up, w_down, num_experts=E,
                               capacity=cap, n_ep=n_ep)
    else:
      y_TD = dropless_exchange(cfg.expert_impl, x_TD, r, w_gate, w_up, w_down, num_experts=E,
                               n_ep=n_ep, exchange=exchange)
    return y_TD.astype(x_TD.dtype), local_stat_sums(r, E)

  # Stats leave as per-device sums and are added up outside: no psum inside, so the
  # gradients are right with or without vma checking. pallas_call (gmm) does not declare
  # how its output varies over the mesh, which check_vma=True requires.
  tok, ex = P(TOKEN_AXES), P(EP)
  fn = jax.shard_map(local, mesh=mesh, in_specs=(tok, P(), P(), ex, ex, ex),
                     out_specs=(tok, tok), check_vma=cfg.expert_impl != "gmm")
  y_TD, sums = fn(x_TD, router_DE, bias_E, w_gate_EDF, w_up_EDF, w_down_EFD)
  return y_TD, global_stats(sums, E, T)
