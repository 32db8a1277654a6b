"""Expert offload (issue 36), the mechanism: a Transformer cut into per-layer jitted programs
whose routed experts come from a pool of HBM slots, and the host copies of the experts.

  OffloadModel   each block's other weights on the device; its routed experts one host array
                 per (MoE layer, expert, weight), in memory kind pinned_host where the device
                 has it (CPU and GPU do), else numpy: one code path, the placement a parameter.
  attention      Block.__call__ up to the router (a dense block: all of it), the shared
                 experts' output, and the lookahead gate's scores of the next MoE layers
                 (prefetch.LookaheadGate's math).
  routed_experts one experts pass: the model's own MoE.experts (expert_ffn /
                 quantized_expert_ffn) on the pool, expert ids remapped to slots, added to the
                 shared experts and earlier passes; the last pass adds the residual.
  write_slot     a staged expert into its slot (donated pool, dynamic_update_slice in place);
                 write_slot_from_host: the same, the program reading the host-memory array.

Each program holds the model's ops in the model's order, so cutting the forward into them
changes no bit in float32: every slot count and expert_impl, except `dense` in a layer that
needs several passes (tests/inference/test_offload.py). In bfloat16 the cut meets XLA's
excess precision (xla_allow_excess_precision, on by default): inside one program XLA may keep
a bf16 intermediate in float32, while a value crossing programs is rounded; with the flag off
the offloaded forward is bitwise the in-memory one in bfloat16 too.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.config import Config, MoEConfig
from moejax.inference.sampling import SamplingConfig, sample
from moejax.model import routing
from moejax.model.moe import FLOAT_EXPERT_NAMES, QUANTIZED_EXPERT_NAMES

EXPERT_NAMES = frozenset(FLOAT_EXPERT_NAMES + QUANTIZED_EXPERT_NAMES)


def _is_expert(path, _value) -> bool:
  return str(path[-1]) in EXPERT_NAMES


def host_placement(kind: str | None = None):
  """Where the host copies live: a Sharding of memory kind `kind` on device 0, or None for
  numpy arrays ("numpy"). None picks pinned_host where the device has that memory kind."""
  dev = jax.devices()[0]
  kinds = {m.kind for m in dev.addressable_memories()}
  if kind is None:
    kind = "pinned_host" if "pinned_host" in kinds else "numpy"
  if kind == "numpy":
    return None
  if kind not in kinds:
    raise ValueError(f"host memory {kind!r}: {dev} has memory kinds {sorted(kinds)} (or numpy)")
  return jax.sharding.SingleDeviceSharding(dev, memory_kind=kind)


@dataclasses.dataclass(frozen=True, eq=False)
class BlockDef:
  """A block's static structure: the jit key of its programs (equal for same-shaped layers).
  Hashed once: every program call looks it up, and hashing a graphdef walks the module."""
  graphdef: Any
  expert_treedef: Any     # the routed experts' State structure (no leaves for a dense block)
  is_moe: bool
  moe: MoEConfig
  norm_eps: float

  def _key(self) -> tuple:
    return (self.graphdef, self.expert_treedef, self.is_moe, self.moe, self.norm_eps)

  def __hash__(self) -> int:
    if "_hash" not in self.__dict__:
      object.__setattr__(self, "_hash", hash(self._key()))
    return self.__dict__["_hash"]

  def __eq__(self, other) -> bool:
    return self is other or (isinstance(other, BlockDef) and hash(self) == hash(other)
                             and self._key() == other._key())


def merge_block(d: BlockDef, state, experts=None):
  """The block module; `experts` (leaves in expert_treedef order) default to empty arrays for
  the programs that never read them, which then hold no reference to the slot pool."""
  if experts is None:
    experts = [jnp.zeros((0,), jnp.float32)] * d.expert_treedef.num_leaves
  return nnx.merge(d.graphdef, jax.tree.unflatten(d.expert_treedef, list(experts)), state)


class OffloadModel:
  def __init__(self, cfg: Config, embed_VD, final_norm, lm_head_DV=None, placement=None):
    self.cfg, self.placement = cfg, placement
    self.dtype = jnp.dtype(cfg.model.dtype)
    self.embed_VD, self.lm_head_DV = embed_VD, lm_head_DV
    self.norm_def, self.norm_state = nnx.split(final_norm)
    self.defs: list[BlockDef] = []
    self.states: list[Any] = []
    self.host: dict[int, list[tuple]] = {}   # layer -> [expert] -> leaves
    self.expert_shapes: list[tuple[tuple[int, ...], Any]] = []

  @classmethod
  def from_model(cls, model, placement=None) -> "OffloadModel":
    om = cls(model.cfg, model.embed_VD[...], model.final_norm,
             None if model.lm_head_DV is None else model.lm_head_DV[...], placement)
    for block in model.blocks:
      om.add_block(block)
    return om

  @classmethod
  def from_split(cls, cfg: Config, graphdef, params, buffers, placement=None) -> "OffloadModel":
    return cls.from_model(nnx.merge(graphdef, params, buffers), placement)

  def add_block(self, block) -> None:
    """Appends the next layer, its experts copied to the host one at a time (a builder can
    drop the block, and its device experts, before building the next)."""
    graphdef, experts, rest = nnx.split(block, _is_expert, ...)
    leaves, treedef = jax.tree.flatten(experts)
    layer = len(self.defs)
    self.defs.append(BlockDef(graphdef, treedef, block.is_moe, self.cfg.moe, block.ffn_norm.eps))
    self.states.append(rest)
    if not block.is_moe:
      return
    shapes = [(leaf.shape[1:], leaf.dtype) for leaf in leaves]
    if self.expert_shapes and shapes != self.expert_shapes:
      raise ValueError(f"layer {layer}: experts {shapes}, other layers {self.expert_shapes}")
    self.expert_shapes = shapes
    put = np.asarray if self.placement is None else (
        lambda x: jax.device_put(x, self.placement))
    self.host[layer] = [tuple(put(leaf[e]) for leaf in leaves) for e in range(leaves[0].shape[0])]

  def truncated(self, num_layers: int) -> "OffloadModel":
    """The first num_layers layers (arrays shared): a shallower model of the same shape."""
    cfg = dataclasses.replace(self.cfg, model=dataclasses.replace(self.cfg.model,
                                                                  num_layers=num_layers))
    out = OffloadModel.__new__(OffloadModel)
    out.__dict__.update(self.__dict__, cfg=cfg, defs=self.defs[:num_layers],
                        states=self.states[:num_layers],
                        host={l: v for l, v in self.host.items() if l < num_layers})
    return out

  @property
  def moe_layers(self) -> list[int]:
    return sorted(self.host)

  @property
  def num_experts(self) -> int:
    return self.cfg.moe.num_experts

  @property
  def expert_bytes(self) -> int:
    return sum(int(np.prod(s)) * np.dtype(t).itemsize for s, t in self.expert_shapes)


def expert_bytes_of(cfg: Config) -> int:
  """OffloadModel.expert_bytes of a model of this config in the decode layout (load.
  decode_layout, as OffloadEngine.from_trained builds it), from shapes alone: sizes a byte
  budget before any checkpoint is read."""
  from moejax.inference.load import decode_layout
  from moejax.state import build_model, split_model
  model = nnx.eval_shape(lambda: nnx.merge(*decode_layout(*split_model(build_model(cfg, 0)))))
  leaves = jax.tree.leaves(nnx.split(model, _is_expert, ...)[1])
  layers = sum(b.is_moe for b in model.blocks)
  return sum(int(np.prod(x.shape[1:])) * np.dtype(x.dtype).itemsize for x in leaves) // max(
      layers, 1)


# ------------------------------------------------------------------ programs ---

@functools.partial(jax.jit, static_argnums=0)
def embed(dtype, embed_VD, tokens_BT):
  return embed_VD[tokens_BT].astype(dtype)   # Transformer.__call__


def _gate_scores(d: BlockDef, x_BTD, gates):
  """Each next layer's router on this layer's FFN input RMS-normalized with that layer's norm
  scale, as its selection scores: [n, T, E]."""
  if not gates:
    return None
  x_TD = x_BTD.reshape(-1, x_BTD.shape[-1]).astype(jnp.float32)
  n_TD = x_TD * jax.lax.rsqrt(jnp.mean(x_TD * x_TD, axis=-1, keepdims=True) + d.norm_eps)
  out = []
  for scale_D, router_DE, bias_E in gates:
    logits_TE = (n_TD * scale_D.astype(jnp.float32)) @ router_DE.astype(jnp.float32)
    s_TE = logits_TE if d.moe.routing == "topk_softmax" else jax.nn.softmax(logits_TE, axis=-1)
    out.append(s_TE if bias_E is None else s_TE + bias_E)
  return jnp.stack(out)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def attention(d: BlockDef, state, x_BTD, cache, positions_BT, gates):
  """-> (x, h = FFN input, route, used_TK (expert, or -1 where not kept), shared experts' output
  or None, cache, gate scores, the FFN's input residual in float32 for host predictors).
  A dense block: x after its FFN, the rest None."""
  block = merge_block(d, state)
  a, cache = block.attn(block.attn_norm(x_BTD), positions_BT, cache)
  x_BTD = x_BTD + a
  B, T, D = x_BTD.shape
  scores = _gate_scores(d, x_BTD, gates)
  hidden_TD = x_BTD.reshape(B * T, D).astype(jnp.float32)
  h_BTD = block.ffn_norm(x_BTD)
  if not d.is_moe:
    return x_BTD + block.ffn(h_BTD), None, None, None, None, cache, scores, hidden_TD
  ffn = block.ffn
  x_TD = h_BTD.reshape(B * T, D)
  r = ffn.route(x_TD)
  used_TK = jnp.where(r.keep_TK, r.expert_TK, -1)
  shared_TD = ffn.shared_out(x_TD)
  return (x_BTD, h_BTD, (r.expert_TK, r.weight_TK, r.keep_TK), used_TK, shared_TD, cache,
          scores, hidden_TD)


def contracts_over_experts(impl: str, platform: str) -> bool:
  """The expert implementations whose sums run over the expert axis: `dense` (one-hot
  einsums) and, on the CPU, `ragged` (lax.ragged_dot is lowered there to a masked dense
  contraction over groups x rows, whose association depends on the group count)."""
  return impl == "dense" or (impl == "ragged" and platform == "cpu")


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def routed_experts(d: BlockDef, capacity: int, last: bool, expand: bool, state, x_BTD, h_BTD,
                   route, slot_E, pool, acc_TD):
  """One experts pass: MoE.experts over the pool, expert e -> slot slot_E[e] (-1: not in
  this pass, contributes nothing), added to acc_TD (the shared experts' output and earlier
  passes) as MoE.__call__ adds its shared experts, so that XLA folds the addition into the
  experts' scatter-add as it does in the model. last: also Block.__call__'s residual -> x.
  expand (contracts_over_experts): run on the model's [E, ...] layout, each expert at its own
  index (the others alias slot 0 and receive no token), so the sums over the expert axis run
  in the model's order; those implementations compute every expert anyway."""
  expert_TK, weight_TK, keep_TK = route
  if expand:
    pool = [p[jnp.maximum(slot_E, 0)] for p in pool]
    slot_E = jnp.where(slot_E >= 0, jnp.arange(slot_E.shape[0]), -1)
  ffn = merge_block(d, state, pool).ffn
  B, T, D = h_BTD.shape
  slot_TK = slot_E[expert_TK]
  r = routing.Routing(jnp.maximum(slot_TK, 0), weight_TK, keep_TK & (slot_TK >= 0),
                      None, None, None)
  y_TD = ffn.experts(h_BTD.reshape(B * T, D), r, capacity)
  if acc_TD is not None:
    y_TD = y_TD + acc_TD
  if not last:
    return y_TD
  return x_BTD + y_TD.reshape(B, T, D).astype(h_BTD.dtype)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def head(norm_def, dtype, tied: bool, sampling: SamplingConfig, norm_state, w_head, x_BTD, key,
         fold):
  """Transformer.__call__'s final norm and LM head (w_head: embed_VD when tied, else
  lm_head_DV), then Engine's sampling of the last position with fold_in(key, fold).
  -> (tokens_B, logits_BV)."""
  x = nnx.merge(norm_def, norm_state)(x_BTD)
  w = w_head.T if tied else w_head
  logits_BTV = jnp.dot(x, w.astype(dtype), preferred_element_type=jnp.float32)
  return (sample(logits_BTV[:, -1], jax.random.fold_in(key, fold), sampling),
          logits_BTV[:, -1])


@functools.partial(jax.jit, donate_argnums=0)
def write_slot(pool, expert, slot):
  return [jax.lax.dynamic_update_index_in_dim(p, x, slot, 0) for p, x in zip(pool, expert)]


@functools.partial(jax.jit, donate_argnums=0, static_argnums=3)
def write_slot_from_host(pool, expert, slot, device):
  moved = [jax.device_put(x, device) for x in expert]   # the copy, inside the program
  return [jax.lax.dynamic_update_index_in_dim(p, x, slot, 0) for p, x in zip(pool, moved)]
