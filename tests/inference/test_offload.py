"""Expert offload (issue 36) on the CPU: offloaded decode against in-memory decode, token for
token and bit for bit, at every HBM slot count and policy; the statistics; the policies on
crafted access sequences; predictive prefetch with an oracle; bad budgets."""
import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import load_config
from moejax.inference import Engine, SamplingConfig, dense_caches
from moejax.inference.offload import OffloadModel, host_placement
from moejax.inference.offload_cache import OffloadCache
from moejax.inference.offload_engine import OffloadEngine
from moejax.inference.prefetch import LookaheadGate
from moejax.state import build_model, split_model

# test_generate's shapes: float32 compute, a larger init so greedy choices are not near-ties.
SMALL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
         "model.head_dim=32", "model.ffn_hidden=48", "moe.expert_hidden=24", "moe.num_experts=4",
         "model.max_seq_len=128", "model.dtype=float32", "model.init_std=0.2"]
POLICIES = ("lru", "lfu", "predictive")
PROMPT_LENGTHS, NEW = (5, 9, 7), 8


def _build(overrides=()):
  cfg = load_config(None, SMALL + list(overrides))
  graphdef, params, buffers = split_model(build_model(cfg, 0))
  caches = functools.partial(dense_caches, dtype=jnp.dtype(cfg.model.dtype))
  return dict(cfg=cfg, split=(cfg, graphdef, params, buffers), caches=caches,
              om=OffloadModel.from_split(cfg, graphdef, params, buffers, host_placement()))


def _prompts(lengths=PROMPT_LENGTHS, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, n).tolist() for n in lengths]


def _engine_tokens(m, prompts, new=NEW):
  return Engine(*m["split"], cache_factory=m["caches"]).generate(prompts, new)[0]


def _stepwise_logits(m, prompts, new=NEW):
  """In-memory greedy decode, one jitted model call per forward (the weights arguments, as in
  Engine): each forward's last-position logits. Equal-length prompts."""
  cfg, graphdef, params, buffers = m["split"]

  @jax.jit
  def step(params, buffers, tokens_BT, positions_BT, caches):
    logits, _, caches = nnx.merge(graphdef, params, buffers)(tokens_BT, positions_BT, caches)
    return logits[:, -1], caches

  B, P = len(prompts), len(prompts[0])
  caches = jax.jit(lambda: m["caches"](cfg, B, P + new))()
  logits, caches = step(params, buffers, np.array(prompts, np.int32),
                        np.broadcast_to(np.arange(P, dtype=np.int32), (B, P)), caches)
  out = [np.asarray(logits)]
  for i in range(new - 1):
    tokens = out[-1].argmax(-1).astype(np.int32)[:, None]
    logits, caches = step(params, buffers, tokens, np.full((B, 1), P + i, np.int32), caches)
    out.append(np.asarray(logits))
  return out


def _offload(m, slots, policy="lru", **kw):
  return OffloadEngine(m["om"], slots=slots, policy=policy, cache_factory=m["caches"], **kw)


@pytest.fixture(scope="module")
def small():
  return _build()


def _total(m):
  return len(m["om"].moe_layers) * m["om"].num_experts


# --------------------------------------------------------------- equality ---

@pytest.mark.parametrize("policy", POLICIES)
def test_offloaded_greedy_equals_in_memory_for_every_slot_count(small, policy):
  prompts = _prompts()
  expected = _engine_tokens(small, prompts)
  assert len({tuple(x) for x in expected}) == 3        # not degenerate
  for slots in range(1, _total(small) + 1):
    new, caches = _offload(small, slots, policy).generate(prompts, NEW)
    assert new == expected, f"{policy}, {slots} slots"
    assert int(caches[0].length) == max(PROMPT_LENGTHS) + NEW - 1


def _assert_bitwise(m, slot_counts, policies=("predictive",), prompts=None):
  """Every forward's logits equal the in-memory ones bit for bit (predictive: slots filled in
  prediction order, so a layer's slots are rarely in expert order)."""
  prompts = prompts or _prompts((5, 5, 5), seed=1)
  expected = _stepwise_logits(m, prompts)
  for policy in policies:
    for slots in slot_counts:
      eng = _offload(m, slots, policy, record=True)
      eng.generate(prompts, NEW)
      for i, (got, want) in enumerate(zip(eng.logits_log, expected)):
        assert np.array_equal(got, want), (policy, slots, i, np.abs(got - want).max())


def test_offloaded_logits_are_bitwise_the_in_memory_ones(small):
  """Top-2, ragged: every slot count (1 slot: a pass per expert; < 4: several a layer)."""
  _assert_bitwise(small, range(1, _total(small) + 1), ("lru", "predictive"))


@pytest.mark.parametrize("overrides", [
    # K = 3 (ordered passes), shared experts and their gate, a dense layer, selection bias,
    # capacity drops.
    ("moe.expert_impl=blocked", "moe.routing=top_p", "moe.max_k=3", "moe.top_p=0.8",
     "moe.num_shared_experts=1", "moe.shared_expert_gate=true", "moe.first_dense_layers=1",
     "model.num_layers=3", "moe.bias_balancing=true", "moe.capacity_factor=1.5"),
    # the GPU path (Pallas gmm, interpret mode here) with int8 experts and a shared expert.
    ("moe.expert_impl=gmm", "inference.expert_bits=8", "inference.expert_group_size=16",
     "moe.expert_hidden=32", "moe.num_shared_experts=1"),
], ids=["blocked-top_p-shared-dense-bias-capacity", "gmm-int8-shared"])
def test_offloaded_logits_are_bitwise_with_every_model_option(overrides):
  _assert_bitwise(_build(overrides), (3,))   # 3 of 4 (8) slots: several passes a layer


def test_dense_impl_is_bitwise_when_a_layer_fits_in_one_pass():
  """`dense` sums a token's experts in one einsum: exact when a layer's experts are in the
  slots at once (the prefill needs all 4 of a layer); with fewer, equal tokens."""
  m = _build(["moe.expert_impl=dense"])
  prompts = _prompts((5, 5, 5), seed=1)
  _assert_bitwise(m, (4,), prompts=prompts)
  assert _offload(m, 1, "predictive").generate(prompts, NEW)[0] == _engine_tokens(m, prompts)


def test_bfloat16_is_bitwise_without_xla_excess_precision(tmp_path):
  """In bfloat16 one XLA program may keep an intermediate in float32 (excess precision, on
  by default) where a value crossing programs is rounded; without it the cut changes no bit.
  A subprocess: the flag is read when the backend starts."""
  script = tmp_path / "bf16.py"
  script.write_text(textwrap.dedent(f"""
      import sys
      sys.path.insert(0, {os.path.dirname(__file__)!r})
      import test_offload as t
      t._assert_bitwise(t._build(["model.dtype=bfloat16", "model.param_dtype=bfloat16"]), (3,))
      print("bitwise")
      """))
  env = dict(os.environ, XLA_FLAGS="--xla_allow_excess_precision=false", JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=300)
  assert run.returncode == 0 and "bitwise" in run.stdout, run.stderr[-2000:]


def test_sampling_and_stop_tokens_follow_engine(small):
  prompts = _prompts((4, 7), seed=3)
  engine = Engine(*small["split"], cache_factory=small["caches"])
  hot = SamplingConfig(temperature=1.0, top_k=8)
  sampled = engine.generate(prompts, NEW, sampling=hot, seed=5)[0]
  offload = _offload(small, 2, "predictive")
  assert offload.generate(prompts, NEW, sampling=hot, seed=5)[0] == sampled
  stop = sampled[0][1]
  assert (offload.generate(prompts, NEW, sampling=hot, seed=5, stop_tokens=(stop,))[0]
          == engine.generate(prompts, NEW, sampling=hot, seed=5, stop_tokens=(stop,))[0])


def test_transfer_modes_and_numpy_host_copies_agree(small):
  prompts = _prompts()
  expected = _engine_tokens(small, prompts)
  in_jit = _offload(small, 3, "predictive", transfer="in_jit")
  assert in_jit.generate(prompts, NEW)[0] == expected
  cfg, graphdef, params, buffers = small["split"]
  om = OffloadModel.from_split(cfg, graphdef, params, buffers, placement=None)
  assert isinstance(om.host[0][0][0], np.ndarray)
  eng = OffloadEngine(om, slots=3, policy="predictive", cache_factory=small["caches"])
  assert eng.generate(prompts, NEW)[0] == expected
  assert eng.stats["decode"].misses == in_jit.stats["decode"].misses


# ------------------------------------------------------------- statistics ---

@pytest.mark.parametrize("policy", POLICIES)
def test_statistics_add_up(small, policy):
  eng = _offload(small, 3, policy, record=True)
  eng.generate(_prompts(), NEW)
  eb = small["om"].expert_bytes
  assert eb == 3 * 32 * 24 * 4
  pre, dec = eng.stats["prefill"], eng.stats["decode"]
  # uses: each (forward, layer)'s distinct experts, from the routing the engine saw.
  uses = {"prefill": 0, "decode": 0}
  for (pos, _), used_TE in eng.routing_log.items():
    uses["prefill" if pos == 0 else "decode"] += int(used_TE.any(0).sum())
  for phase, s in eng.stats.items():
    assert s.hits + s.misses == s.uses == uses[phase]
    assert s.bytes_h2d == (s.misses + s.prefetches) * eb
  assert pre.forwards == 1 and dec.forwards == len(eng.forward_log) - 1 >= NEW - 1
  assert dec.tokens == 3 * dec.forwards
  assert pre.bytes_h2d + dec.bytes_h2d == eng.transferred_bytes   # what was really copied
  issued = pre.prefetches + dec.prefetches
  settled = pre.prefetch_used + dec.prefetch_used + pre.prefetch_wasted + dec.prefetch_wasted
  assert issued == settled + len(eng.cache.pending_prefetches)
  assert sum(f["misses"] for f in eng.forward_log) == pre.misses + dec.misses
  if policy == "predictive":
    assert dec.prefetches > 0 and dec.prefetch_used > 0
  else:
    assert issued == 0
  assert dec.passes >= dec.forwards * len(small["om"].moe_layers)


def test_one_slot_runs_a_pass_per_expert(small):
  eng = _offload(small, 1)
  eng.generate(_prompts(), NEW)
  for s in eng.stats.values():
    assert s.hits == 0 and s.passes == s.uses == s.misses   # every expert evicts the last


@pytest.mark.parametrize("policy", POLICIES)
def test_preload_makes_every_step_a_hit_and_keeps_decode_exact(small, policy):
  prompts, total = _prompts(), _total(small)
  eng = _offload(small, total, policy)
  assert eng.preload() == total and eng.preload() == 0            # the second finds all there
  assert eng.transferred_bytes == total * small["om"].expert_bytes
  new, _ = eng.generate(prompts, NEW)
  assert new == _engine_tokens(small, prompts)
  for s in eng.stats.values():
    assert s.misses == s.prefetches == 0 and s.hits == s.uses > 0
  part = _offload(small, 3, policy)                               # fewer slots: the first 3
  layer = small["om"].moe_layers[0]
  assert part.preload([(layer, 2), (layer, 0), (layer, 1), (layer, 3)]) == 3
  assert set(part.cache.slot_of) == {(layer, 2), (layer, 0), (layer, 1)}
  assert part.generate(prompts, NEW)[0] == new


def test_preload_stages_one_layer_at_a_time(small, monkeypatch):
  """Staged copies are device memory beyond the pool: preloading every expert must not hold
  them all at once (that ran a 48 GB preload out of HBM)."""
  eng, staged = _offload(small, _total(small)), []
  real_load = eng._load

  def load(key, slot):
    real_load(key, slot)
    staged.append(sum(len(v) for v in eng.pending.values()))

  monkeypatch.setattr(eng, "_load", load)
  eng.preload()
  assert max(staged) == small["om"].num_experts and not eng.pending


def test_preload_refuses_keys_outside_the_model(small):
  eng = _offload(small, 2)
  with pytest.raises(ValueError, match=r"preload key \(0, 9\)"):
    eng.preload([(small["om"].moe_layers[0], 0), (0, 9)])


# --------------------------------------------------------------- policies ---

def _misses(policy, sequence, slots=2):
  cache = OffloadCache(slots, policy)
  for key in sequence:
    cache.acquire([key])
    cache.release()
  return cache.stats.misses, set(cache.slot_of)


def test_fill_counts_no_use_and_evicts_nothing():
  cache = OffloadCache(2, "lru")
  assert cache.fill([(0, 0), (0, 1), (0, 2)]) == [((0, 0), 0), ((0, 1), 1)]
  assert cache.stats.uses == cache.stats.misses == cache.stats.evictions == 0
  assert cache.acquire([(0, 1)])[1] == [] and cache.stats.hits == 1   # a filled key hits
  cache.release()
  cache.acquire([(0, 2)])          # a miss evicts the least recent: the filled, unused (0, 0)
  assert set(cache.slot_of) == {(0, 1), (0, 2)}


def test_lru_and_lfu_evict_differently():
  a, b, c = (0, 0), (0, 1), (0, 2)
  # After a a a b the cache holds {a, b}; c evicts the least recent (a) under LRU and the
  # least used (b) under LFU; then a hits under LFU only, and b under LRU only.
  assert _misses("lru", [a, a, a, b, c]) == (3, {b, c})
  assert _misses("lfu", [a, a, a, b, c]) == (3, {a, c})
  assert _misses("lru", [a, a, a, b, c, a])[0] == 4
  assert _misses("lfu", [a, a, a, b, c, a])[0] == 3
  assert _misses("lru", [a, a, a, b, c, b])[0] == 3
  assert _misses("lfu", [a, a, a, b, c, b])[0] == 4


def _visit(cache, key):
  cache.visit(key[0])
  slots = cache.acquire([key])
  cache.release()
  return slots


def test_predictive_evicts_the_layer_needed_last_lru_the_one_needed_next():
  # Layers 0, 1, 2 visited in a cycle, 2 slots: at layer 2, a (layer 0) is needed next and b
  # (layer 1) after it. LRU evicts a, Belady's rule (predictive) evicts b.
  a, b, c = (0, 0), (1, 0), (2, 0)
  for policy, kept in (("lru", b), ("predictive", a)):
    cache = OffloadCache(2, policy, layers=[0, 1, 2])
    for key in (a, b, c):
      _visit(cache, key)
    assert set(cache.slot_of) == {kept, c}, policy


def test_predictive_keeps_the_expert_used_more_often():
  # Layer 0's experts x (used every visit) and y (used once) against layer 1's z: at equal
  # distance the rarely used one goes.
  x, y, z = (0, 0), (0, 1), (1, 0)
  cache = OffloadCache(2, "predictive", layers=[0, 1])
  for _ in range(3):
    _visit(cache, x)
    cache.visit(1)                     # layer 1 visited, nothing routed there yet
  cache.visit(0)
  cache.acquire([x, y])
  cache.release()
  _visit(cache, z)
  assert set(cache.slot_of) == {x, z}
  assert cache.next_use(y) > cache.next_use(x)


def test_predictive_prefetch_takes_only_what_is_needed_later():
  a, b, c, d = (0, 0), (1, 0), (2, 0), (3, 0)
  cache = OffloadCache(2, "predictive", layers=[0, 1, 2, 3])
  _visit(cache, a)
  _visit(cache, b)
  # At layer 1, c (layer 2) is wanted: it takes b's slot (b's layer comes again last).
  assert cache.prefetch([c]) == [(c, cache.slot_of[c])] and set(cache.slot_of) == {a, c}
  _visit(cache, c)
  assert cache.stats.prefetches == cache.stats.prefetch_used == 1 and cache.stats.misses == 2
  # At layer 3, d evicts c (needed last); d is pinned, and a (layer 0, next) is needed sooner
  # than the wanted b (layer 1): the prefetch finds no slot.
  cache.visit(3)
  cache.acquire([d])
  assert set(cache.slot_of) == {a, d}
  assert cache.prefetch([b]) == [] and set(cache.slot_of) == {a, d}
  cache.release()


def test_next_token_estimates_keep_what_the_next_token_wants():
  # 2 slots, layers 0 and 1 in a cycle. After layer 1, layer 0's a and b are both resident
  # ... with one slot left for c (layer 1): by use rate alone a and b tie; told that the
  # next token wants b, the cache evicts a.
  a, b, c = (0, 0), (0, 1), (1, 0)
  for estimates, kept in (({}, None), ({a: 0.0, b: 0.9}, b), ({a: 0.9, b: 0.0}, a)):
    cache = OffloadCache(2, "predictive", layers=[0, 1])
    cache.visit(0)
    cache.acquire([a, b])
    cache.release()
    cache.expect(estimates)
    _visit(cache, c)
    if kept is not None:
      assert set(cache.slot_of) == {kept, c}, estimates
      assert cache.next_use(kept) < cache.next_use(a if kept == b else b)
  # An estimate holds until its layer's visit, then the use rate is back.
  cache.expect({b: 0.0})
  assert b in cache.expected
  cache.visit(0)
  assert b not in cache.expected


def test_learned_next_token_maps_feed_the_cache_and_keep_decode_exact():
  from moejax.inference.prefetch import Learned, next_token_pairs
  from moejax.inference.routing_trace import record_trace
  from moejax.inference.load import TrainedModel
  from moejax.data import ByteTokenizer
  m = _build(["moe.num_experts=8", "moe.first_dense_layers=1", "model.num_layers=3"])
  cfg, graphdef, params, buffers = m["split"]
  tm = TrainedModel(cfg, graphdef, params, buffers, ByteTokenizer(), 0)
  trace = record_trace(tm, [np.random.default_rng(3).integers(0, 256, (4, 32)).astype(np.int32)])
  learned = Learned.fit(trace, [(0, 1), (1, 2)], next_pairs=next_token_pairs(cfg))
  prompts = _prompts((7,), seed=2)
  seen = []
  eng = _offload(m, 4, "predictive", predictor=learned)
  expect = eng.cache.expect
  eng.cache.expect = lambda est: (seen.append(dict(est)), expect(est))
  assert eng.generate(prompts, 10)[0] == _engine_tokens(m, prompts, 10)
  # Every forward: from layer 1 the estimates of layer 1, from layer 2 those of 1 and 2.
  assert len(seen) == 2 * 10 and {k[0] for k in seen[0]} == {1} and len(seen[1]) == 16
  assert all(0.0 <= p <= 1.0 for est in seen for p in est.values())
  no_next = _offload(m, 4, "predictive", predictor=Learned(learned.maps))
  assert no_next.generate(prompts, 10)[0] == _engine_tokens(m, prompts, 10)
  assert no_next.cache.expected == {}


class _Oracle:
  """Knows each forward's routing (from a recorded run): scores = the experts it will use."""
  name = "oracle"

  def __init__(self, routing_log):
    self.log = routing_log

  def scores(self, trace, src, dst):
    return self.log[(int(trace.position_T[0]), dst)].astype(np.float32)


def test_predictive_with_an_oracle_has_no_decode_misses():
  """A dense first layer, then 2 MoE layers of 8 experts; one sequence, top-2. With the oracle
  and 2 x top_k slots, each layer's experts arrive while the layer before runs: after the
  prefill (the warm-up) no expert is fetched on demand and no prefetch is wasted."""
  m = _build(["moe.num_experts=8", "moe.first_dense_layers=1", "model.num_layers=3"])
  prompts = _prompts((7,), seed=2)
  ref = _offload(m, _total(m), record=True)
  tokens = ref.generate(prompts, 12)[0]
  assert tokens == _engine_tokens(m, prompts, 12)
  oracle = _offload(m, 4, "predictive", predictor=_Oracle(ref.routing_log),
                    prefetch_width=2)
  assert oracle.generate(prompts, 12)[0] == tokens
  dec = oracle.stats["decode"]
  assert dec.misses == 0 and dec.prefetch_wasted == 0 and dec.hits == dec.uses == 11 * 2 * 2
  assert dec.prefetch_used == dec.prefetches > 0
  lru = _offload(m, 4, "lru")
  lru.generate(prompts, 12)
  assert lru.stats["decode"].misses > 0        # the same budget without prediction


def test_host_predictor_matches_the_in_jit_gate(small):
  model = nnx.merge(*small["split"][1:])
  layers = {i: {"scale_D": np.asarray(b.ffn_norm.scale[...]),
                "router_DE": np.asarray(b.ffn.router_DE[...]), "bias_E": None}
            for i, b in enumerate(model.blocks)}
  gate = LookaheadGate(small["cfg"], layers, model.blocks[0].ffn_norm.eps)
  prompts = _prompts()
  runs = [_offload(small, 3, "predictive", predictor=p) for p in ("gate", gate)]
  assert runs[0].generate(prompts, NEW)[0] == runs[1].generate(prompts, NEW)[0]
  assert runs[0].stats == runs[1].stats and runs[0].stats["decode"].prefetches > 0


# ----------------------------------------------------------------- errors ---

@pytest.mark.parametrize("kwargs, match", [
    (dict(slots=0), "at least 1 slot"),
    (dict(slots=9), "more than the 8 experts"),
    (dict(budget_bytes=100), "holds no expert"),
    (dict(slots=2, budget_bytes=10 ** 6), "exactly one of"),
    (dict(slots=2, policy="fifo"), "choose one of lru, lfu, predictive"),
    (dict(slots=2, transfer="dma"), "choose one of device_put, in_jit"),
    (dict(slots=2, policy="predictive", lookahead=2), "lookahead 2"),
    (dict(slots=2, policy="predictive", predictor="oracle"), "predictor 'oracle'"),
])
def test_bad_settings_get_clear_errors(small, kwargs, match):
  with pytest.raises(ValueError, match=match):
    OffloadEngine(small["om"], **kwargs)


def test_budget_bytes_give_whole_slots(small):
  eb = small["om"].expert_bytes
  assert OffloadEngine(small["om"], budget_bytes=3 * eb + eb // 2).slots == 3
  with pytest.raises(ValueError, match="in_jit.*placement"):
    cfg, graphdef, params, buffers = small["split"]
    OffloadEngine(OffloadModel.from_split(cfg, graphdef, params, buffers), slots=2,
                  transfer="in_jit")
