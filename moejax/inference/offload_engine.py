"""Generation with offloaded experts (issue 36): a host-driven loop over offload.py's per-layer
programs, with offload_cache.py deciding what sits in the HBM slots.

Per forward (the prefill, or one decode step) and layer L:
  1. `attention` (async dispatch); the host reads L's chosen experts: a device-to-host read of
     a few ints, tens of µs, next to the milliseconds a PCIe expert miss costs; with it every
     policy is plain Python.
  2. the cache acquires them; misses are copied in now; the staged experts of L (misses and
     earlier prefetches) are written into their slots; `routed_experts` (with the residual).
  3. predictive: the predictor's candidates for the MoE layers L+1..L+d are issued: the host-
     to-device copy starts at once (jax.device_put returns before it ends) and overlaps the
     layers in between; the slot write waits until the layer that reads it.
A layer that needs more experts than the slots hold runs in passes of at most `slots`
experts, each adding onto the last (routed_experts). A token's output sums its K experts and,
if the model has them, the shared experts' output; up to two such terms add exactly in any
grouping. With three or more the order matters: the model's scatter-add adds a token's experts
in ascending expert order (onto the shared output, where XLA folds that addition into it), so
unless one pass holds them in slots of that order, each expert gets a pass of its own, in that
order. Both are bitwise the model's.

Transfers (`transfer`): "device_put" stages an expert with an asynchronous jax.device_put and
writes it into its slot with a donated dynamic_update_slice (a device copy) just before its
layer; "in_jit" writes the slot at once in a program that reads the host-memory array (XLA
issues the copy; the program runs in the device's program order, so whether a copy overlaps
the computations dispatched after it is for the GPU to show: experiments/bench_offload.py).
Staged experts are device memory beyond the slots: at most the prefetches in flight.
"""
from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import OFFLOAD_TRANSFERS as TRANSFERS
from moejax.config import Config, ConfigError, is_moe_layer
from moejax.inference import offload as off
from moejax.inference import prefetch
from moejax.inference.generate import CacheFactory, dense_caches, pad_prompts
from moejax.inference.load import TrainedModel, decode_layout
from moejax.inference.offload_cache import OffloadCache, OffloadStats
from moejax.inference.routing_trace import RoutingTrace
from moejax.inference.sampling import SamplingConfig
from moejax.model import routing



def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def offload_slots(cfg: Config) -> int | None:
  """The HBM slots inference.offload asks for (None: offload off), from shapes alone, so a
  budget below one expert is refused before any checkpoint is read. A budget above every
  expert gives every expert a slot (it is a ceiling)."""
  o = cfg.inference.offload
  if not o.enabled:
    return None
  if o.hbm_expert_slots:
    return o.hbm_expert_slots
  eb = off.expert_bytes_of(cfg)
  if o.hbm_budget_bytes < eb:
    bits = cfg.inference.expert_bits
    kind = cfg.model.dtype if bits == 16 else f"int{bits} + scales"
    raise ConfigError(f"inference.offload.hbm_budget_bytes={o.hbm_budget_bytes:,} holds no "
                      f"expert: one expert (d_model {cfg.model.d_model} x expert_hidden "
                      f"{cfg.moe.expert_hidden}, {kind}) is {eb:,} bytes; the HBM pool needs "
                      "at least 1 slot")
  total = sum(is_moe_layer(cfg, i) for i in range(cfg.model.num_layers)) * cfg.moe.num_experts
  return min(o.hbm_budget_bytes // eb, total)


def _learned_distances(cfg: Config) -> list[int]:
  """The lookahead distances a learned predictor must hold for inference.offload.lookahead:
  every d up to it with a pair (the engine prefetches each MoE layer 1..d ahead)."""
  return [d for d in range(1, cfg.inference.offload.lookahead + 1)
          if prefetch.layer_pairs(cfg, d)]


def check_offload(cfg: Config, run_dir: str | Path | None = None) -> int | None:
  """offload_slots, and for predictor learned that run_dir has a predictor file: what can be
  refused before the weights are read."""
  slots = offload_slots(cfg)
  o = cfg.inference.offload
  if slots is None or o.predictor != "learned":   # (config: learned needs policy predictive)
    return slots
  if run_dir is None:
    raise ValueError("inference.offload.predictor=learned reads RUN_DIR/predictor.npz: pass "
                     "run_dir")
  path = Path(run_dir) / prefetch.PREDICTOR_FILE
  if not path.is_file():
    raise FileNotFoundError(f"{path}: no learned predictor (inference.offload.predictor="
                            f"learned); fit one: moejax train-predictor {run_dir} --lookahead "
                            f"{' '.join(map(str, _learned_distances(cfg)))}")
  return slots


def offload_host_sharding(cfg: Config) -> jax.sharding.Sharding | None:
  """Where inference.offload.host_memory keeps the experts: a host memory kind's sharding,
  or None for numpy arrays."""
  kind = cfg.inference.offload.host_memory
  return off.host_placement(None if kind == "auto" else kind)


class OffloadEngine:
  """Engine.generate's contract with offloaded experts.

  slots or budget_bytes: the HBM pool (budget_bytes // expert bytes slots), from 1 to every
  expert of every MoE layer. policy: lru | lfu | predictive (offload_cache.py). predictive:
  lookahead d; prefetch_width m: each token's top-m experts of each of the next d MoE layers
  (default top_k); predictor "gate" (lookahead gate, computed in `attention`) or an object with
  scores(trace, src, dst) (prefetch.py), called on a RoutingTrace of this forward whose
  hidden_LTD[src] is filled (not `previous`, which needs earlier tokens' rows).
  stats: {"prefill", "decode"} OffloadStats since reset_stats(); forward_log: per forward
  (phase, seconds, hits, misses, prefetches). record: also routing_log[(first position of the
  forward, layer)] = used_TE and logits_log (each forward's last-position logits).
  """

  def __init__(self, om: off.OffloadModel, *, slots: int | None = None,
               budget_bytes: int | None = None, policy: str = "lru", lookahead: int = 1,
               prefetch_width: int | None = None, predictor: Any = "gate",
               transfer: str = "device_put", cache_factory: CacheFactory = dense_caches,
               record: bool = False):
    if not om.moe_layers:
      raise ValueError("the model has no MoE layer: nothing to offload")
    total = len(om.moe_layers) * om.num_experts
    if (slots is None) == (budget_bytes is None):
      raise ValueError("give exactly one of slots (hbm_expert_slots) and budget_bytes")
    if budget_bytes is not None:
      slots = int(budget_bytes) // om.expert_bytes
      if slots < 1:
        raise ValueError(f"budget_bytes={budget_bytes} holds no expert ({om.expert_bytes} bytes "
                         "each): the HBM cache needs at least 1 slot")
    if _is_int(slots) and slots > total:
      raise ValueError(f"hbm_expert_slots={slots}: more than the {total} experts "
                       f"({len(om.moe_layers)} MoE layers x {om.num_experts}); at most {total}")
    self.cache = OffloadCache(slots, policy, om.expert_bytes, layers=om.moe_layers,
                              use_prior=routing.slots_per_token(om.cfg.moe) / om.num_experts)
    if transfer not in TRANSFERS:
      raise ValueError(f"transfer {transfer!r}: choose one of {', '.join(TRANSFERS)}")
    if transfer == "in_jit" and om.placement is None:
      raise ValueError("transfer='in_jit' reads a host memory kind: build the OffloadModel "
                       "with a placement (offload.host_placement('pinned_host'))")
    if isinstance(predictor, str) and predictor != "gate" or (
        not isinstance(predictor, str) and not hasattr(predictor, "scores")):
      raise ValueError(f"predictor {predictor!r}: 'gate' or an object with "
                       "scores(trace, src, dst) (moejax.inference.prefetch)")
    L = om.cfg.model.num_layers
    if policy == "predictive" and not (_is_int(lookahead) and 1 <= lookahead < L):
      raise ValueError(f"lookahead {lookahead!r}: must be in [1, {L - 1}]")
    self.om, self.slots, self.policy, self.transfer = om, int(slots), policy, transfer
    self.cache_factory, self.predictor, self.record = cache_factory, predictor, record
    self.prefetch_width = prefetch_width or routing.slots_per_token(om.cfg.moe)
    self.device = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
    self.platform = jax.devices()[0].platform
    self.pool = [jnp.zeros((self.slots,) + s, t) for s, t in om.expert_shapes]
    self.pending: dict[int, list] = {}     # layer -> [(key, slot, staged leaves)]
    self.transferred_bytes = 0             # counted where the copies are issued
    self.routing_log, self.logits_log, self.forward_log = {}, [], []
    moe = set(om.moe_layers)
    d = lookahead if policy == "predictive" else 0
    self.dsts = {l: [t for t in range(l + 1, min(l + d, L - 1) + 1) if t in moe]
                 for l in range(L)}
    self.gates = {l: self._gates(self.dsts[l]) if isinstance(predictor, str) else ()
                  for l in range(L)}
    self.host_predictor = not isinstance(predictor, str)
    # A learned predictor's next-token maps from l: estimates for the layers l has passed.
    next_maps = getattr(predictor, "next_maps", {}) if policy == "predictive" else {}
    self.next_dsts = {l: [t for t in om.moe_layers if (l, t) in next_maps] for l in range(L)}
    self.reset_stats()

  @classmethod
  def from_trained(cls, tm: TrainedModel, cache_factory: CacheFactory = dense_caches, *,
                   run_dir: str | Path | None = None, record: bool = False) -> "OffloadEngine":
    """The engine tm.cfg.inference.offload describes, on tm's weights in the decode layout
    Engine runs (so the same tokens). predictor learned: run_dir's predictor.npz, fit for
    every distance up to lookahead (moejax train-predictor)."""
    o, cfg = tm.cfg.inference.offload, tm.cfg
    slots = check_offload(cfg, run_dir)
    if slots is None:
      raise ConfigError("inference.offload is off: set inference.offload.hbm_expert_slots "
                        "or inference.offload.hbm_budget_bytes")
    predictor: Any = "gate"
    if o.predictor == "learned":   # check_offload found the file
      predictor = prefetch.load_predictor(Path(run_dir), tm, _learned_distances(cfg))[0]
    placement = offload_host_sharding(cfg)
    om = off.OffloadModel.from_split(cfg, *decode_layout(tm.graphdef, tm.params, tm.buffers),
                                     placement)
    return cls(om, slots=slots, policy=o.policy, lookahead=o.lookahead,
               prefetch_width=o.prefetch_width or None, predictor=predictor,
               transfer=o.transfer, cache_factory=cache_factory, record=record)

  def stats_line(self) -> str:
    """One line on what the generate calls since reset_stats() cost, decode per token."""
    pre, dec = self.stats["prefill"], self.stats["decode"]
    total = len(self.om.moe_layers) * self.om.num_experts
    line = (f"[expert offload ({self.policy}, {self.slots} of {total} experts in HBM, "
            f"{self.om.expert_bytes:,} bytes each): ")
    if dec.tokens:
      n = dec.tokens
      line += (f"decode hit rate {dec.hit_rate:.1%}, {dec.misses / n:.2f} misses and "
               f"{dec.bytes_h2d / n:,.0f} bytes host->device per token")
      if self.policy == "predictive":
        line += f", {dec.prefetches} prefetched ({dec.prefetch_used} used)"
    else:
      line += "no decode step"
    return line + f"; prefill {pre.misses} misses, {pre.bytes_h2d:,} bytes]"

  def reset_stats(self) -> None:
    eb = self.om.expert_bytes
    self.stats = {"prefill": OffloadStats(eb), "decode": OffloadStats(eb)}
    self.forward_log = []

  def preload(self, keys: Sequence[tuple[int, int]] | None = None) -> int:
    """Copies experts into the empty HBM slots before generating: `keys` ((layer, expert)
    pairs) in order, default every expert layer by layer, as many as the slots hold. With a
    slot for every expert this is the all-resident baseline (no miss at any step). Counted
    in transferred_bytes, not in stats. -> the experts loaded."""
    moe, E = self.om.moe_layers, self.om.num_experts
    if keys is None:
      keys = [(l, e) for l in moe for e in range(E)]
    keys = [(int(l), int(e)) for l, e in keys]
    for l, e in keys:
      if l not in moe or not 0 <= e < E:
        raise ValueError(f"preload key ({l}, {e}): layer must be an MoE layer {moe} and "
                         f"expert in [0, {E})")
    loads = self.cache.fill(keys)
    for layer, run in itertools.groupby(loads, key=lambda load: load[0][0]):
      for k, s in run:
        self._load(k, s)
      self._flush(layer)   # staged copies beyond the slots: at most one layer's at a time
    return len(loads)

  def _gates(self, dsts) -> tuple:
    out = []
    for t in dsts:
      block = off.merge_block(self.om.defs[t], self.om.states[t])
      bias_E = block.ffn.bias_E
      out.append((block.ffn_norm.scale[...], block.ffn.router_DE[...],
                  None if bias_E is None else bias_E[...]))
    return tuple(out)

  # ----------------------------------------------------------- generate ---

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
               sampling: SamplingConfig = SamplingConfig(), stop_tokens: Sequence[int] = (),
               seed: int = 0) -> tuple[list[list[int]], list]:
    """Engine.generate, step by step: prefill the shortest prompt's length, then a sequence is
    fed its prompt while inside it, else its sampled token (Engine's keys: the same tokens)."""
    cfg = self.om.cfg
    prompt_BP, lengths_B = pad_prompts(prompts, cfg.model.vocab_size)
    N = max_new_tokens
    if not _is_int(N) or N < 1:
      raise ValueError(f"max_new_tokens {N!r}: must be an integer >= 1")
    B, P = prompt_BP.shape
    P0, capacity = int(lengths_B.min()), P + int(N)
    if capacity > cfg.model.max_seq_len:
      raise ValueError(f"longest prompt ({P}) + new tokens ({N}) exceed "
                       f"model.max_seq_len={cfg.model.max_seq_len}")
    stops = np.asarray(tuple(stop_tokens) or (-1,), np.int32)
    key = jax.random.key(seed)
    caches = jax.jit(lambda: self.cache_factory(cfg, B, capacity))()
    positions = np.broadcast_to(np.arange(P0, dtype=np.int32), (B, P0))
    cand_B = self._forward(prompt_BP[:, :P0], positions, caches, key, P0, "prefill", sampling)
    new_BN, num_new_B = np.full((B, N), -1, np.int32), np.zeros(B, np.int32)
    done_B = np.zeros(B, bool)

    def advance(pos, cand_B):   # Engine's advance, in numpy
      in_prompt_B = pos < lengths_B
      is_new_B = ~in_prompt_B & ~done_B
      for b in np.flatnonzero(is_new_B):
        new_BN[b, pos - lengths_B[b]] = cand_B[b]
      num_new_B[:] += is_new_B
      done_B[:] |= is_new_B & (np.isin(cand_B, stops) | (num_new_B >= N))
      return np.where(in_prompt_B, prompt_BP[:, min(pos, P - 1)], cand_B).astype(np.int32)

    pos = P0
    feed_B = advance(pos, cand_B)
    while not done_B.all() and pos < capacity:
      cand_B = self._forward(feed_B[:, None], np.full((B, 1), pos, np.int32), caches, key,
                             pos + 1, "decode", sampling)
      pos += 1
      feed_B = advance(pos, cand_B)
    return [row[:n].tolist() for row, n in zip(new_BN, num_new_B)], caches

  # ------------------------------------------------------------ forward ---

  def _forward(self, tokens_BT, positions_BT, caches, key, fold, phase, sampling):
    om, stats = self.om, self.stats[phase]
    t0, before = time.perf_counter(), (stats.hits, stats.misses, stats.prefetches)
    self.cache.stats = stats
    stats.forwards += 1
    stats.tokens += tokens_BT.size
    self._trace = None
    positions_BT = jnp.asarray(positions_BT)
    x = off.embed(om.dtype, om.embed_VD, jnp.asarray(tokens_BT))
    for l, d in enumerate(om.defs):
      x, h, route, used_TK, shared_TD, caches[l], scores, hidden_TD = off.attention(
          d, om.states[l], x, caches[l], positions_BT, self.gates[l])
      host_hidden = self.host_predictor and (self.dsts[l] or self.next_dsts[l])
      used_TK, scores, hidden_TD = jax.device_get(   # the layer's one sync
          (used_TK, scores, hidden_TD if host_hidden else None))
      if d.is_moe:
        if self.record:
          self.routing_log[(int(positions_BT[0, 0]), l)] = _used_TE(used_TK, om.num_experts)
        x = self._experts(l, d, x, h, route, used_TK, shared_TD)
      if self.next_dsts[l]:
        self._expect_next(l, hidden_TD, positions_BT.shape)
      if self.dsts[l]:
        if scores is None:
          scores = self._host_scores(l, hidden_TD, positions_BT)
        self._prefetch(l, scores)
    w_head = om.embed_VD if om.lm_head_DV is None else om.lm_head_DV
    cand_B, logits_BV = off.head(om.norm_def, om.dtype, om.lm_head_DV is None, sampling,
                                 om.norm_state, w_head, x, key, fold)
    cand_B = np.asarray(cand_B)
    after = (stats.hits, stats.misses, stats.prefetches)
    self.forward_log.append(dict(phase=phase, seconds=time.perf_counter() - t0,
                                 **{k: a - b for k, a, b in
                                    zip(("hits", "misses", "prefetches"), after, before)}))
    if self.record:
      self.logits_log.append(np.asarray(logits_BV))
    return cand_B

  def _experts(self, l, d, x, h, route, used_TK, shared_TD):
    """The layer's experts in passes of at most `slots` experts -> x after the layer."""
    need = sorted(int(e) for e in np.unique(used_TK) if e >= 0)
    B, T = h.shape[:2]
    capacity = routing.expert_capacity(d.moe, B * T) or B * T
    # Up to two terms per token (experts, shared output) add exactly in any order; dense sums
    # them in one einsum (exact in one pass only); expanded passes keep the model's layout.
    terms = used_TK.shape[1] + (shared_TD is not None)
    any_order = terms <= 2 or d.moe.expert_impl == "dense"
    expand = off.contracts_over_experts(d.moe.expert_impl, self.platform)
    groups = [need[i:i + self.slots] for i in range(0, len(need), self.slots)] or [[]]
    acc = shared_TD
    self.cache.visit(l)
    for g, group in enumerate(groups):
      slots, loads = self.cache.acquire([(l, e) for e in group])
      for k, s in loads:
        self._load(k, s)
      self._flush(l)
      runs = [list(zip(group, slots))]
      if not any_order and (len(groups) > 1 or (not expand and slots != sorted(slots))):
        runs = [[pair] for pair in runs[0]]   # the model's order: ascending, one at a time
      for i, run in enumerate(runs):
        slot_E = np.full(self.om.num_experts, -1, np.int32)
        for e, s in run:
          slot_E[e] = s
        last = g == len(groups) - 1 and i == len(runs) - 1
        acc = off.routed_experts(d, capacity, last, expand, self.om.states[l], x, h, route,
                                 slot_E, self.pool, acc)
        self.cache.stats.passes += 1
      self.cache.release()
    return acc

  # ----------------------------------------------------------- transfers ---

  def _load(self, key, slot) -> None:
    l, e = key
    leaves = self.om.host[l][e]
    self.transferred_bytes += sum(int(x.nbytes) for x in leaves)
    if self.transfer == "in_jit":
      self.pool = off.write_slot_from_host(self.pool, leaves, np.int32(slot), self.device)
    else:   # returns at once: the copy runs while the layers before `l` compute
      self.pending.setdefault(l, []).append((key, slot, jax.device_put(leaves, self.device)))

  def _flush(self, layer) -> None:
    """Writes the staged experts of `layer` into their slots (those not evicted meanwhile)."""
    for key, slot, staged in self.pending.pop(layer, ()):
      if self.cache.slot_of.get(key) == slot:
        self.pool = off.write_slot(self.pool, list(staged), np.int32(slot))

  # ------------------------------------------------------------ prefetch ---

  def _prefetch(self, src, scores_nTE) -> None:
    """The cache's wish list: each next MoE layer in order; its experts among any token's
    top-m, most confidently predicted first."""
    ranked = []
    for dst, s_TE in zip(self.dsts[src], scores_nTE):
      s_TE = np.asarray(s_TE, np.float32)
      m = min(self.prefetch_width, s_TE.shape[-1])
      top = np.unique(np.argsort(-s_TE, axis=-1, kind="stable")[:, :m])
      best = s_TE[:, top].max(axis=0)
      ranked += [(dst, int(top[i])) for i in np.argsort(-best, kind="stable")]
    for k, s in self.cache.prefetch(ranked):
      self._load(k, s)

  def _expect_next(self, src, hidden_TD, shape_BT) -> None:
    """The cache's estimates, for every MoE layer at or before src, that the next forward
    (each sequence's token after its last one here) uses each expert there: one minus the
    chance that no sequence does, from the next-token maps' per-sequence estimates."""
    B, T = shape_BT
    last_BD = np.asarray(hidden_TD).reshape(B, T, -1)[:, -1]
    estimates = {}
    for dst in self.next_dsts[src]:
      p_BE = np.clip(self.predictor.next_scores(last_BD, src, dst), 0.0, 1.0)
      p_E = 1.0 - np.prod(1.0 - p_BE, axis=0)
      estimates.update({(dst, e): float(p) for e, p in enumerate(p_E)})
    self.cache.expect(estimates)

  def _host_scores(self, src, hidden_TD, positions_BT) -> list[np.ndarray]:
    """A host predictor's scores on a RoutingTrace of this forward (hidden_LTD[src] filled)."""
    om = self.om
    if self._trace is None:
      T, D, E = hidden_TD.shape[0], hidden_TD.shape[1], om.num_experts
      M, K = len(om.moe_layers), routing.slots_per_token(om.cfg.moe)
      self._trace = RoutingTrace(np.zeros((len(om.defs), T, D), np.float32),
                                 np.zeros((M, T, K), np.int32), np.zeros((M, T, K), bool),
                                 np.zeros((M, T, E), np.float32),
                                 np.asarray(positions_BT).reshape(-1), tuple(om.moe_layers))
    self._trace.hidden_LTD[src] = np.asarray(hidden_TD)
    return [self.predictor.scores(self._trace, src, dst) for dst in self.dsts[src]]


def _used_TE(used_TK: np.ndarray, E: int) -> np.ndarray:
  out = np.zeros((used_TK.shape[0], E), bool)
  for k in range(used_TK.shape[1]):
    rows = np.flatnonzero(used_TK[:, k] >= 0)
    out[rows, used_TK[rows, k]] = True
  return out
