"""Which experts sit in the HBM slots (issue 36: expert offload at decode): bookkeeping only,
no JAX. offload_engine.py moves the weights; this module decides what moves and counts it.

One global pool of `num_slots` slots serves every MoE layer: a slot holds one expert of any
layer, keyed (layer, expert). Global rather than a count per layer, so that the budget is one
number (slots, or bytes / expert bytes), a layer whose routing is spread takes more slots
than a concentrated one, and one slot is a legal (if slow) budget.

Policies (the victim is always an unpinned slot; an empty slot first):
  lru         on demand only; evict the least recently used.
  lfu         on demand only; evict the least frequently used (uses counted over the whole
              run, evicted or not; ties: least recently used).
  predictive  the engine also prefetches the predictor's candidates for the next layers
              (`prefetch`), and every eviction follows Belady's rule (evict what is needed
              furthest ahead) on an estimate: decode visits the MoE layers in a cycle, so an
              expert of layer l is next needed after its layer's distance ahead in the cycle,
              plus one cycle for each visit it is expected to sit out (1/p - 1, p its use rate
              at its layer's visits so far; for a wanted expert, at least the predictor's
              precision so far). LRU is the worst order for such a cycle: it evicts the
              layer needed next. A prefetch evicts only what is needed later than itself.
              `expect` gives estimates of p for the next visit of layers the token has
              passed (a next-token predictor: prefetch.Learned.next_scores); they replace
              the use rate until that visit. Only these can cut the bytes: the experts of
              the layers still ahead in the token are the ones it is about to fetch anyway.

`acquire` pins the experts one experts pass needs (a pass never evicts its own); `release`
unpins them once the pass is dispatched. A prefetch only ever takes an empty or unwanted slot,
so it never evicts a pinned expert or one needed sooner than itself.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

from moejax.config import OFFLOAD_POLICIES as POLICIES
Key = tuple[int, int]   # (model layer, expert)
MIN_EXPECTED = 0.02     # floor of an estimated p (a regression's estimate can be <= 0)


@dataclasses.dataclass
class OffloadStats:
  """Counters of one phase (prefill or decode). uses = hits + misses: (layer, expert) pairs a
  forward needed (each expert once per layer and forward, however many tokens chose it).
  prefetch_used / prefetch_wasted: prefetched experts that were hit at least once / evicted
  before any use; a prefetch still waiting is pending (OffloadCache.pending_prefetches)."""
  expert_bytes: int = 0
  forwards: int = 0        # model forwards (a decode step is one)
  tokens: int = 0          # tokens those forwards processed
  uses: int = 0
  hits: int = 0
  misses: int = 0          # fetched on demand
  prefetches: int = 0
  prefetch_used: int = 0
  prefetch_wasted: int = 0
  evictions: int = 0
  passes: int = 0          # experts programs run (> MoE layers when a layer needs more slots)

  @property
  def bytes_h2d(self) -> int:
    return (self.misses + self.prefetches) * self.expert_bytes

  @property
  def hit_rate(self) -> float:
    return self.hits / max(self.uses, 1)

  def per_forward(self) -> dict:
    n = max(self.forwards, 1)
    return {"hit_rate": self.hit_rate, "misses": self.misses / n,
            "prefetches": self.prefetches / n, "MB_h2d": self.bytes_h2d / n / 1e6}


class OffloadCache:
  """layers: the MoE layers in visiting order (the predictive policy's cycle; default: those
  seen so far); use_prior: an expert's use rate before its layer is visited (top_k / E)."""

  def __init__(self, num_slots: int, policy: str, expert_bytes: int = 0,
               layers: Iterable[int] = (), use_prior: float = 0.25):
    if policy not in POLICIES:
      raise ValueError(f"offload policy {policy!r}: choose one of {', '.join(POLICIES)}")
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
      raise ValueError(f"hbm_expert_slots={num_slots!r}: the HBM cache needs at least 1 slot")
    self.num_slots, self.policy = num_slots, policy
    self.key_of: list[Key | None] = [None] * num_slots
    self.slot_of: dict[Key, int] = {}
    self.last_use: dict[Key, int] = {}
    self.count: dict[Key, int] = {}       # LFU: uses over the whole run
    self.pinned: set[Key] = set()
    self.wanted: dict[Key, int] = {}      # predictive: key -> rank (0 = wanted first)
    self.pending_prefetches: set[Key] = set()   # prefetched, not yet hit
    self.clock = 0
    self.stats = OffloadStats(expert_bytes)
    self.use_prior = use_prior
    self.visits: dict[int, int] = {}      # layer -> visits (forwards that reached it)
    self.current: int | None = None       # the layer visited last
    self._order: list[int] = sorted(set(layers))
    self.predicted = self.predicted_used = 0    # wanted keys whose layer came / were used
    self._due: set[Key] = set()                 # wanted keys of the layer being visited
    self.expected: dict[Key, float] = {}        # estimated p at the key's next visit

  def visit(self, layer: int) -> None:
    """The engine enters MoE layer `layer` (once a forward, before its passes)."""
    self.current = layer
    self.visits[layer] = self.visits.get(layer, 0) + 1
    self._see(layer)
    self._due = {k for k in self.wanted if k[0] == layer}
    self.predicted += len(self._due)
    self.expected = {k: p for k, p in self.expected.items() if k[0] != layer}   # now due

  @property
  def precision(self) -> float:
    """Share of wanted experts used when their layer came (Laplace-smoothed)."""
    return (self.predicted_used + 1) / (self.predicted + 2)

  def _see(self, layer: int) -> None:
    if layer not in self._order:
      self._order = sorted(self._order + [layer])

  # ------------------------------------------------------------ demand ---

  def acquire(self, keys: Iterable[Key]) -> tuple[list[int], list[tuple[Key, int]]]:
    """Pins `keys` (distinct) for one experts pass -> (their slots, the (key, slot) loads the
    engine must copy in: the misses)."""
    keys = list(keys)
    if len(keys) > self.num_slots:
      raise ValueError(f"a pass of {len(keys)} experts does not fit {self.num_slots} slots")
    self.pinned.update(keys)
    loads = []
    for key in keys:
      self._see(key[0])
      if self.current is None:
        self.current = key[0]
      self.clock += 1
      self.stats.uses += 1
      self.count[key] = self.count.get(key, 0) + 1
      if key in self._due:
        self._due.discard(key)
        self.predicted_used += 1
      if key in self.slot_of:
        self.stats.hits += 1
        if key in self.pending_prefetches:
          self.pending_prefetches.discard(key)
          self.stats.prefetch_used += 1
      else:
        self.stats.misses += 1
        loads.append((key, self._place(key, self._victim(prefetch=False))))
      self.last_use[key] = self.clock
    return [self.slot_of[k] for k in keys], loads

  def release(self) -> None:
    self.pinned.clear()

  # ---------------------------------------------------------- prefetch ---

  def want(self, ranked: Iterable[Key]) -> None:
    """The predictor's wish list for the next layers, most wanted first (replaces the last)."""
    self.wanted = {}
    for key in ranked:
      self.wanted.setdefault(key, len(self.wanted))
      self._see(key[0])

  def prefetch(self, ranked: Iterable[Key]) -> list[tuple[Key, int]]:
    """want(ranked), then the loads of the wanted experts not resident, in rank order, as long
    as an empty or unwanted slot is left for them."""
    self.want(ranked)
    loads = []
    for key in self.wanted:
      if key in self.slot_of:
        continue
      slot = self._victim(prefetch=True, incoming=key)
      if slot is None:
        break
      self.clock += 1
      self._place(key, slot)
      self.last_use[key] = self.clock
      self.pending_prefetches.add(key)
      self.stats.prefetches += 1
      loads.append((key, slot))
    return loads

  def fill(self, keys: Iterable[Key]) -> list[tuple[Key, int]]:
    """A warm start: keys not resident go into empty slots, in order, while one is left ->
    the loads. Counts no use, hit or miss, and evicts nothing."""
    loads, free = [], iter([s for s, k in enumerate(self.key_of) if k is None])
    for key in keys:
      if key in self.slot_of:
        continue
      slot = next(free, None)
      if slot is None:
        break
      self._see(key[0])
      self.clock += 1
      self.last_use[key] = self.clock
      loads.append((key, self._place(key, slot)))
    return loads

  def expect(self, estimates: dict[Key, float]) -> None:
    """Estimated chances that keys are used at their layers' next visits (replacing earlier
    estimates of the same keys; each is dropped when its layer is visited)."""
    self.expected.update(estimates)

  # ---------------------------------------------------------- eviction ---

  def _distance(self, layer: int) -> int:
    """Layer visits until `layer`'s next one: 1 for the next layer in the cycle, n for the
    current one."""
    n = len(self._order)
    cur = self._order.index(self.current) if self.current in self._order else -1
    return (self._order.index(layer) - cur - 1) % n + 1

  def next_use(self, key: Key) -> float:
    """Predictive: the expected layer visits until `key` is used (module doc)."""
    if key in self.expected:
      p = max(self.expected[key], MIN_EXPECTED)
    else:
      p = (self.count.get(key, 0) + self.use_prior) / (self.visits.get(key[0], 0) + 1)
    if key in self.wanted:
      p = max(p, self.precision)
    return self._distance(key[0]) + len(self._order) * (1 / min(p, 1.0) - 1)

  def _victim(self, prefetch: bool, incoming: Key | None = None) -> int | None:
    free = [s for s, k in enumerate(self.key_of) if k is None]
    if free:
      return free[0]
    keys = [k for k in self.key_of if k not in self.pinned]
    if prefetch:
      keys = [k for k in keys if k not in self.wanted]
    if not keys:
      if prefetch:
        return None
      raise RuntimeError("every slot is pinned")   # acquire's size check rules this out
    if self.policy == "lru":
      return self.slot_of[min(keys, key=lambda k: self.last_use[k])]
    if self.policy == "lfu":
      return self.slot_of[min(keys, key=lambda k: (self.count.get(k, 0), self.last_use[k]))]
    # predictive: needed furthest ahead; ties: unwanted before wanted, the wanted one wanted
    # last, the oldest
    victim = max(keys, key=lambda k: (self.next_use(k), k not in self.wanted,
                                      self.wanted.get(k, 0), -self.last_use[k]))
    if incoming is not None and self.next_use(victim) <= self.next_use(incoming):
      return None   # a prefetch never evicts what is needed no later than itself
    return self.slot_of[victim]

  def _place(self, key: Key, slot: int) -> int:
    old = self.key_of[slot]
    if old is not None:
      del self.slot_of[old]
      self.stats.evictions += 1
      if old in self.pending_prefetches:
        self.pending_prefetches.discard(old)
        self.stats.prefetch_wasted += 1
    self.key_of[slot] = key
    self.slot_of[key] = slot
    return slot
