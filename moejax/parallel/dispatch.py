"""Expert-parallel MoE inside jax.shard_map: route locally, exchange tokens, run local experts.

Layout over the mesh ("data", "expert", "model"): tokens are split over data x expert
(every device routes its own T_l tokens), expert weights are split along `expert`
(E_l = E / n_ep experts per device) and replicated along `data`. Exchanges run over the
`expert` axis only, so each data-parallel replica is an independent EP group.

Capacity mode (moe.capacity_factor > 0): per-device capacity C = expert_capacity(cfg, T_l),
counted from the device's *own* tokens. Each device fills an [E, C, D] buffer (a token's
top-1 choice has priority over its top-2, earlier tokens over later, as on one device) and
one `all_to_all` hands every expert its n_ep * C rows. This equals the single-device model
applied to each device's tokens as a separate routing group; it equals the single-device
model on the whole batch exactly when nothing is dropped.

Dropless mode (capacity_factor = 0): assignments are sorted by expert and sent as ragged
chunks (`jax.lax.ragged_all_to_all` on GPU/TPU). XLA:CPU has no ragged all-to-all, so on
CPU (or with mesh.exchange=padded) each chunk is padded to the worst case and sent with a
plain `all_to_all`: same results, n_ep times the exchange bytes. The receive buffer is
sized for the worst case either way: n_ep * T_l * min(k, E_l) rows.

The received rows go through `expert_ffn` with the same `expert_impl` (dense | ragged |
blocked | gmm) and come back by the reverse exchange. Routing, capacity and the load
statistics come from model/routing.py, as on one device; each device returns its
`stat_sums` and they are added up over all devices, so the statistics equal the global ones.

Shape letters beyond the project's legend (moejax/__init__.py), local to this module:
P peers along the expert axis (n_ep), X experts local to this device (E_l), M a device's
sent rows (its T_l * K assignments), R received rows, I / O rows of an exchange's operand
/ output.

The model does not import this module: `ExpertParallel` is handed to
`Transformer(..., ep=...)`, so the dependency runs parallel -> model only.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from moejax.config import EXCHANGES, MoEConfig
from moejax.model import routing
from moejax.model.experts import expert_ffn
from moejax.parallel.mesh import TOKEN_AXES

EP = "expert"


def resolve_exchange(exchange: str = "auto") -> str:
  """auto -> ragged where XLA implements ragged-all-to-all (GPU, TPU), else padded."""
  if exchange not in EXCHANGES:
    raise ValueError(f"unknown exchange {exchange!r}; choose one of {', '.join(EXCHANGES)}")
  if exchange == "auto":
    return "ragged" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "padded"
  return exchange


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
  """What MoE layers need to run expert-parallel: the mesh and the dropless exchange.

  Given to the model (`Transformer(cfg, rngs=..., ep=ep)`); a static attribute, so it is
  neither a parameter nor part of a checkpoint.
  """
  mesh: Mesh
  exchange: str = "auto"

  def __call__(self, cfg: MoEConfig, x_TD, router_DE, bias_E, w_gate_EDF, w_up_EDF,
               w_down_EFD):
    return moe_experts(self.mesh, cfg, x_TD, router_DE, bias_E, w_gate_EDF, w_up_EDF,
                       w_down_EFD, exchange=self.exchange)


def expert_parallel(mesh: Mesh | None, exchange: str = "auto") -> ExpertParallel | None:
  """The model's `ep` for a training mesh; None (the single-device layer) without a mesh or
  on a one-device mesh."""
  if mesh is None or mesh.size == 1:
    return None
  return ExpertParallel(mesh, resolve_exchange(exchange))


# ------------------------------------------------------------- exchanges ---

def padded_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                             recv_sizes, *, axis_name):
  """jax.lax.ragged_all_to_all semantics (one chunk per peer) from a dense all_to_all:
  every chunk is padded to operand's full length. operand [I, ...], output [O, ...]."""
  I, O = operand.shape[0], output.shape[0]
  rows_I = jnp.arange(I, dtype=jnp.int32)
  src_PI = input_offsets[:, None] + rows_I[None, :]
  chunks = operand.at[src_PI].get(mode="fill", fill_value=0)            # [P, I, ...]
  live_PI = rows_I[None, :] < send_sizes[:, None]
  chunks = jnp.where(live_PI.reshape(live_PI.shape + (1,) * (operand.ndim - 1)), chunks, 0)
  recv = jax.lax.all_to_all(chunks, axis_name, 0, 0)                      # [P src, I, ...]
  dest_off_P = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
  dest_PI = jnp.where(rows_I[None, :] < recv_sizes[:, None], dest_off_P[:, None] + rows_I, O)
  return output.at[dest_PI].set(recv, mode="drop")


def _ragged_a2a(exchange: str):
  if exchange == "ragged":
    return lambda *a, axis_name: jax.lax.ragged_all_to_all(*a, axis_name=axis_name)
  return padded_ragged_all_to_all


def _exclusive_cumsum(x):
  return jnp.cumsum(x) - x


# ---------------------------------------------------------- local experts ---

def _local_experts(impl, x_RD, e_R, valid_R, w_gate, w_up, w_down):
  """Every received row goes to one local expert with weight 1 (combine weights are
  applied on the token's own device)."""
  return expert_ffn(impl, x_RD, e_R[:, None], jnp.ones(e_R.shape + (1,), jnp.float32),
                    valid_R[:, None], w_gate, w_up, w_down, capacity=x_RD.shape[0])


def capacity_exchange(impl, x_TD, r: routing.Routing, w_gate_XDF, w_up_XDF, w_down_XFD, *,
                      num_experts: int, capacity: int, n_ep: int):
  """Per-device [E, C, D] buffers, one all_to_all each way. Local shapes; inside shard_map."""
  T, K = r.expert_TK.shape
  D, E, C = x_TD.shape[1], num_experts, capacity
  X = E // n_ep
  pos_TK = routing.position_in_expert(r.expert_TK, r.keep_TK, E)
  e_TK = jnp.where(r.keep_TK, r.expert_TK, E)                 # E: out of range, dropped
  x_ECD = jnp.zeros((E, C, D), x_TD.dtype).at[e_TK, pos_TK].set(
      jnp.broadcast_to(x_TD[:, None, :], (T, K, D)), mode="drop")
  count_E = routing.expert_counts(r.expert_TK, r.keep_TK, E).astype(jnp.int32)
  # recv[j, e] = rows that device j routed to my local expert e.
  recv_PXCD = jax.lax.all_to_all(x_ECD.reshape(n_ep, X, C, D), EP, 0, 0)
  recv_count_PX = jax.lax.all_to_all(count_E.reshape(n_ep, X), EP, 0, 0)
  x_XPCD = recv_PXCD.transpose(1, 0, 2, 3)
  if impl == "dense":   # the buffers already are the dense impl's [X, P*C, D] layout
    x_XRD = x_XPCD.reshape(X, n_ep * C, D)
    h_XRF = jax.nn.silu(jnp.einsum("xrd,xdf->xrf", x_XRD, w_gate_XDF)) * jnp.einsum(
        "xrd,xdf->xrf", x_XRD, w_up_XDF)
    y_XPCD = jnp.einsum("xrf,xfd->xrd", h_XRF, w_down_XFD).reshape(X, n_ep, C, D)
  else:
    valid_XPC = jnp.arange(C)[None, None, :] < recv_count_PX.T[:, :, None]
    e_XPC = jnp.broadcast_to(jnp.arange(X, dtype=jnp.int32)[:, None, None], (X, n_ep, C))
    y_RD = _local_experts(impl, x_XPCD.reshape(-1, D), e_XPC.reshape(-1), valid_XPC.reshape(-1),
                          w_gate_XDF, w_up_XDF, w_down_XFD)
    y_XPCD = y_RD.reshape(X, n_ep, C, D)
  y_ECD = jax.lax.all_to_all(y_XPCD.transpose(1, 0, 2, 3), EP, 0, 0).reshape(E, C, D)
  y_TKD = y_ECD.at[e_TK, pos_TK].get(mode="fill", fill_value=0)
  return jnp.einsum("tkd,tk->td", y_TKD, r.weight_TK.astype(y_TKD.dtype))


def dropless_exchange(impl, x_TD, r: routing.Routing, w_gate_XDF, w_up_XDF, w_down_XFD, *,
                      num_experts: int, n_ep: int, exchange: str):
  """Assignments sorted by expert, sent as one ragged chunk per peer. Local shapes."""
  T, K = r.expert_TK.shape
  D, E = x_TD.shape[1], num_experts
  X, M = E // n_ep, T * K
  a2a = _ragged_a2a(exchange)
  eid_M = jnp.where(r.keep_TK, r.expert_TK, E).reshape(-1)   # unselected slots sort last
  order_M = jnp.argsort(eid_M, stable=True)
  token_M = order_M // K
  sizes_E = jnp.bincount(eid_M, length=E + 1)[:E].astype(jnp.int32)
  send_P = sizes_E.reshape(n_ep, X).sum(1)
  send_off_P = _exclusive_cumsum(send_P)
  # recv_count[j, e]: rows device j sends to my local expert e; chunks land source-major.
  recv_count_PX = jax.lax.all_to_all(sizes_E.reshape(n_ep, X), EP, 0, 0)
  recv_P = recv_count_PX.sum(1)
  recv_off_P = _exclusive_cumsum(recv_P)
  dest_off_P = jax.lax.all_to_all(recv_off_P, EP, 0, 0, tiled=True)   # where mine land
  R = n_ep * T * min(K, X)                                    # worst case: all come to me
  x_RD = a2a(x_TD[token_M], jnp.zeros((R, D), x_TD.dtype), send_off_P, send_P, dest_off_P,
             recv_P, axis_name=EP)
  seg_R = jnp.searchsorted(jnp.cumsum(recv_count_PX.reshape(-1)), jnp.arange(R), side="right")
  y_RD = _local_experts(impl, x_RD, (seg_R % X).astype(jnp.int32), seg_R < n_ep * X,
                        w_gate_XDF, w_up_XDF, w_down_XFD)
  back_off_P = jax.lax.all_to_all(send_off_P, EP, 0, 0, tiled=True)
  y_MD = a2a(y_RD.astype(x_TD.dtype), jnp.zeros((M, D), x_TD.dtype), recv_off_P, recv_P,
             back_off_P, send_P, axis_name=EP)
  w_M = r.weight_TK.reshape(-1)[order_M]
  y_MD = jnp.where((jnp.arange(M) < sizes_E.sum())[:, None], y_MD * w_M[:, None].astype(
      y_MD.dtype), 0)
  return jnp.zeros_like(x_TD).at[token_M].add(y_MD)


# ------------------------------------------------------------------ layer ---

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
  cap = routing.expert_capacity(cfg, T // n_tok)   # counted per device, as route_tokens does
  has_bias = bias_E is not None
  bias_E = bias_E if has_bias else jnp.zeros((E,), jnp.float32)

  def local(x_TD, router_DE, bias_E, w_gate, w_up, w_down):
    r = routing.route_tokens(cfg, x_TD, router_DE, bias_E if has_bias else None)
    if cap is not None:
      y_TD = capacity_exchange(cfg.expert_impl, x_TD, r, w_gate, w_up, w_down, num_experts=E,
                               capacity=cap, n_ep=n_ep)
    else:
      y_TD = dropless_exchange(cfg.expert_impl, x_TD, r, w_gate, w_up, w_down, num_experts=E,
                               n_ep=n_ep, exchange=exchange)
    return y_TD.astype(x_TD.dtype), {k: v[None] for k, v in routing.stat_sums(r).items()}

  # Stats leave as per-device sums [devices, ...] and are added up outside: no psum inside,
  # so the gradients are right with or without vma checking. pallas_call (gmm) does not
  # declare how its output varies over the mesh, which check_vma=True requires.
  tok, ex = P(TOKEN_AXES), P(EP)
  fn = jax.shard_map(local, mesh=mesh, in_specs=(tok, P(), P(), ex, ex, ex),
                     out_specs=(tok, tok), check_vma=cfg.expert_impl != "gmm")
  y_TD, sums = fn(x_TD, router_DE, bias_E, w_gate_EDF, w_up_EDF, w_down_EFD)
  return y_TD, routing.load_stats({k: v.sum(0) for k, v in sums.items()}, T)
