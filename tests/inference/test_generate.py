"""The on-device generation loop against decodes that share none of its machinery."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import load_config
from moejax.inference import Engine, SamplingConfig, dense_caches
from moejax.kv_eval import KVSetting, quantized_cache_factory
from moejax.state import build_model, split_model

# Float32 compute; a larger init spreads the logits so greedy choices are not near-ties.
SMALL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
         "model.head_dim=32", "model.ffn_hidden=48", "moe.expert_hidden=24", "moe.num_experts=4",
         "model.max_seq_len=128", "model.dtype=float32", "model.init_std=0.2",
         "kv_cache.group_size=16", "kv_cache.residual_window=16", "kv_cache.sink_tokens=2"]
float32_caches = functools.partial(dense_caches, dtype=jnp.float32)


@pytest.fixture(scope="module")
def model():
  cfg = load_config(None, SMALL)
  graphdef, params, buffers = split_model(build_model(cfg, 0))
  return cfg, graphdef, params, buffers


def _prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, n).tolist() for n in lengths]


def _no_cache_greedy(model, prompts, max_new):
  """Recomputes the whole prefix at every step (no cache): each sequence in a fixed-width
  buffer, read at its last position (attention is causal, so the padding after it is unseen)."""
  cfg, graphdef, params, buffers = model
  width = max(map(len, prompts)) + max_new
  forward = jax.jit(lambda t: nnx.merge(graphdef, params, buffers)(t)[0])
  seqs = [list(p) for p in prompts]
  for _ in range(max_new):
    buf = np.zeros((len(seqs), width), np.int32)
    for b, s in enumerate(seqs):
      buf[b, :len(s)] = s
    logits = np.asarray(forward(buf))
    for b, s in enumerate(seqs):
      s.append(int(logits[b, len(s) - 1].argmax()))
  return [s[len(p):] for s, p in zip(seqs, prompts)]


def test_dense_cache_loop_equals_no_cache_greedy_decode(model):
  prompts = _prompts([5, 11, 8])
  engine = Engine(*model, cache_factory=float32_caches)
  new, caches = engine.generate(prompts, 9)
  expected = _no_cache_greedy(model, prompts, 9)
  assert new == expected
  assert len({tuple(x) for x in new}) == 3 and all(len(set(x)) > 2 for x in new)  # not degenerate
  # Every position fed once: the longest prompt and all but its last new token.
  assert int(caches[0].length) == 11 + 9 - 1


def _stepwise_reference(model, factory, prompts, max_new):
  """A plain host loop through the packed cache: prefill the shortest prompt's length, then
  one jitted call per token, prompt tokens fed while inside the prompt, else the argmax."""
  cfg, graphdef, params, buffers = model
  B, P0, P = len(prompts), min(map(len, prompts)), max(map(len, prompts))

  @jax.jit
  def step(tokens_BT, positions_BT, caches):
    logits, _, caches = nnx.merge(graphdef, params, buffers)(tokens_BT, positions_BT, caches)
    return logits[:, -1], caches

  caches = jax.jit(lambda: factory(cfg, B, P + max_new))()   # eager: seconds of op dispatch
  prefix = np.array([p[:P0] for p in prompts], np.int32)
  logits, caches = step(prefix, np.broadcast_to(np.arange(P0, dtype=np.int32), (B, P0)), caches)
  out = [[] for _ in prompts]
  for pos in range(P0, P + max_new):
    choice = np.asarray(logits).argmax(-1)
    feed = [p[pos] if pos < len(p) else int(choice[b]) for b, p in enumerate(prompts)]
    for b, p in enumerate(prompts):
      if pos >= len(p) and len(out[b]) < max_new:
        out[b].append(int(choice[b]))
    if all(len(o) == max_new for o in out):
      return out
    logits, caches = step(np.array(feed, np.int32)[:, None], np.full((B, 1), pos, np.int32), caches)
  raise AssertionError("unreachable")


def test_quantized_cache_loop_equals_stepwise_decode():
  """2-bit packed cache: prefill quantizes a group, decode steps flush more (sinks 2 +
  window 16 + group 16), and the loop must match the host loop token for token. One layer:
  the interpret-mode decode kernel's compile dominates this test's time."""
  cfg = load_config(None, SMALL + ["model.num_layers=1"])
  model = (cfg, *split_model(build_model(cfg, 0)))
  rng = np.random.default_rng(1)
  shape = (cfg.model.num_layers, cfg.model.num_kv_heads, cfg.model.head_dim)
  ranks = {k: np.argsort(rng.random(shape), -1).astype(np.int32)
           for k in ("k_rank_LKD", "v_rank_LKD")}
  factory = quantized_cache_factory(KVSetting(2, 0.15), ranks)
  prompts = _prompts([37, 45, 40], seed=2)
  new, caches = Engine(*model, cache_factory=factory).generate(prompts, 10)
  assert new == _stepwise_reference(model, factory, prompts, 10)
  assert all(len(x) == 10 for x in new)
  assert np.asarray(caches[0].kv.lengths).tolist() == [45 + 10 - 1] * 3


def _cut_at(tokens, stops):
  for i, t in enumerate(tokens):
    if t in stops:
      return tokens[:i + 1]
  return tokens


def test_stop_tokens_end_sequences_and_the_loop(model):
  prompts = _prompts([6, 9, 4], seed=3)
  engine = Engine(*model, cache_factory=float32_caches)
  full, _ = engine.generate(prompts, 8)
  stop = full[0][2]   # sequence 0's third new token
  cut, _ = engine.generate(prompts, 8, stop_tokens=(stop,))
  assert cut == [_cut_at(x, {stop}) for x in full]
  assert cut[0][-1] == stop and len(cut[0]) <= 3
  assert any(len(x) == 8 for x in cut), "the crafted case needs a sequence that continues"
  # When every sequence stops on its first new token, the loop ends once the longest prompt
  # has produced it: the caches hold its prompt and nothing more.
  firsts = tuple({x[0] for x in full})
  short, caches = engine.generate(prompts, 8, stop_tokens=firsts)
  assert short == [[x[0]] for x in full]
  assert int(caches[0].length) == 9


def test_second_call_with_the_same_shapes_does_not_retrace(model):
  engine = Engine(*model, cache_factory=float32_caches)
  sampling = SamplingConfig(temperature=1.0, top_k=8)
  a, _ = engine.generate(_prompts([4, 7]), 5, sampling=sampling, seed=0)
  # Other tokens, seed and lengths, the same batch and shortest / longest prompt.
  engine.generate(_prompts([7, 4], seed=9), 5, sampling=sampling, seed=1)
  c, _ = engine.generate(_prompts([4, 7]), 5, sampling=sampling, seed=0)
  assert engine.num_traces == 1
  assert a == c   # same seed, same tokens
  engine.generate(_prompts([4, 7]), 6, sampling=sampling)   # another budget: a new program
  assert engine.num_traces == 2


def test_sampling_in_the_loop_top_k_1_is_greedy_and_seeded(model):
  prompts = _prompts([5, 8], seed=4)
  engine = Engine(*model, cache_factory=float32_caches)
  greedy, _ = engine.generate(prompts, 6)
  assert engine.generate(prompts, 6, sampling=SamplingConfig(2.0, top_k=1), seed=3)[0] == greedy
  hot = SamplingConfig(temperature=5.0)
  runs = [engine.generate(prompts, 6, sampling=hot, seed=s)[0] for s in (0, 0, 1)]
  assert runs[0] == runs[1] and runs[0] != runs[2]


def test_clear_errors(model):
  engine = Engine(*model)
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    engine.generate([[1, 2], []], 4)
  with pytest.raises(ValueError, match="max_seq_len=128"):
    engine.generate([[1] * 100], 29)
  with pytest.raises(ValueError, match="token-id lists"):
    engine.generate([1, 2, 3], 4)
  with pytest.raises(ValueError, match="in \\[0, 256\\)"):
    engine.generate([[1, 256]], 4)
  with pytest.raises(ValueError, match="max_new_tokens"):
    engine.generate([[1, 2]], 0)
  assert engine.num_traces == 0
