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
              (`prefetch`); every eviction keeps what the predictor wants next: unwanted
              experts go first (least recently used), then the wanted one wanted last.

`acquire` pins the experts one experts pass needs (a pass never evicts its own); `release`
unpins them once the pass is dispatched. A prefetch only ever takes an empty or unwanted slot,
so it never evicts a pinned expert or one wanted sooner than itself.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

POLICIES = ("lru", "lfu", "predictive")
Key = tuple[int, int]   # (model layer, expert)


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
  def __init__(self, num_slots: int, policy: str, expert_bytes: int = 0):
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
      self.clock += 1
      self.stats.uses += 1
      self.count[key] = self.count.get(key, 0) + 1
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

  def prefetch(self, ranked: Iterable[Key]) -> list[tuple[Key, int]]:
    """want(ranked), then the loads of the wanted experts not resident, in rank order, as long
    as an empty or unwanted slot is left for them."""
    self.want(ranked)
    loads = []
    for key in self.wanted:
      if key in self.slot_of:
        continue
      slot = self._victim(prefetch=True)
      if slot is None:
        break
      self.clock += 1
      self._place(key, slot)
      self.last_use[key] = self.clock
      self.pending_prefetches.add(key)
      self.stats.prefetches += 1
      loads.append((key, slot))
    return loads

  # ---------------------------------------------------------- eviction ---

  def _victim(self, prefetch: bool) -> int | None:
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
      order = lambda k: self.last_use[k]
    elif self.policy == "lfu":
      order = lambda k: (self.count.get(k, 0), self.last_use[k])
    else:   # unwanted first by recency, then the wanted one wanted last
      order = lambda k: ((1, -self.wanted[k]) if k in self.wanted else (0, self.last_use[k]))
    return self.slot_of[min(keys, key=order)]

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
