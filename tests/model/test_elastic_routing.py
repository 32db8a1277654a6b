"""Elastic routing (issue 36): the entropy mode's rule and weights, its config checks, and
top_p / entropy decoding through the tiny model with a top-k model's weights."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import ConfigError, load_config
from moejax.model import routing
from moejax.model.experts import expert_ffn
from moejax.state import abstract_model, build_model, split_model


def _entropy_route(logits_TE, *, min_k=1, max_k=4, threshold=0.5, renormalize=True, **kw):
  return routing.route(logits_TE, mode="entropy", top_k=2, renormalize=renormalize,
                       min_k=min_k, max_k=max_k, entropy_threshold=threshold, **kw)


def test_entropy_confident_router_takes_min_k_uniform_takes_max_k():
  E = 8
  one_hot = jnp.zeros((1, E)).at[0, 3].set(20.0)      # h ~ 1e-7
  uniform = jnp.zeros((1, E))                         # h = 1
  r = _entropy_route(jnp.concatenate([one_hot, uniform]), min_k=1, max_k=4)
  np.testing.assert_array_equal(r.selected_TK, [[1, 0, 0, 0], [1, 1, 1, 1]])
  assert int(r.expert_TK[0, 0]) == 3
  np.testing.assert_array_equal(routing.entropy_k(r.probs_TE, 2, 3, 0.5), [2, 3])


def test_entropy_k_follows_the_documented_rule():
  logits_TE = jax.random.normal(jax.random.key(0), (256, 8)) * jnp.linspace(0.1, 6, 256)[:, None]
  probs = np.asarray(jax.nn.softmax(logits_TE), np.float64)
  h = -(probs * np.log(probs)).sum(-1) / np.log(8)
  for min_k, max_k, t in ((1, 4, 0.5), (2, 5, 0.0), (1, 2, 0.8), (3, 3, 0.3)):
    want = min_k + np.ceil((max_k - min_k) * np.clip((h - t) / (1 - t), 0, 1))
    got = np.asarray(routing.entropy_k(jnp.asarray(probs, jnp.float32), min_k, max_k, t))
    steps = (max_k - min_k) * (h - t) / (1 - t)
    tie = np.abs(steps - np.round(steps)) < 1e-4
    np.testing.assert_array_equal(got[~tie], want[~tie])   # away from float ties
    assert got.min() >= min_k and got.max() <= max_k
  k = np.asarray(routing.entropy_k(jnp.asarray(probs, jnp.float32), 1, 4, 0.5))
  assert set(k) == {1, 2, 3, 4}                       # the sample spans every k
  assert np.all(np.diff(k[np.argsort(h)]) >= 0)       # more entropy, never fewer experts


@pytest.mark.parametrize("renormalize", [True, False])
def test_entropy_weights_masked_slots_and_sums(renormalize):
  logits_TE = jax.random.normal(jax.random.key(1), (64, 8)) * 2
  r = _entropy_route(logits_TE, min_k=1, max_k=4, threshold=0.4, renormalize=renormalize)
  probs = np.asarray(r.probs_TE)
  sel = np.asarray(r.selected_TK)
  assert 1 <= sel.sum(-1).min() < sel.sum(-1).max() <= 4      # a variable number of experts
  np.testing.assert_array_equal(r.keep_TK, r.selected_TK)      # dropless: all selected kept
  assert np.all(np.asarray(r.weight_TK)[~sel] == 0.0)          # unused slots weigh nothing
  assert np.all(sel[:, :-1] >= sel[:, 1:])                     # used slots come first
  chosen = np.take_along_axis(probs, np.asarray(r.expert_TK), -1)
  np.testing.assert_array_equal(chosen[:, :-1] >= chosen[:, 1:], True)   # by descending prob
  sums = np.asarray(r.weight_TK).sum(-1)
  want = 1.0 if renormalize else (chosen * sel).sum(-1)
  np.testing.assert_allclose(sums, want, rtol=1e-6)
  stats = routing.load_stats(routing.stat_sums(r), 64)
  assert float(stats["experts_per_token"]) == pytest.approx(sel.sum() / 64)


@pytest.mark.parametrize("renormalize", [True, False])
def test_elastic_modes_at_the_trained_k_weight_experts_as_softmax_topk(renormalize):
  """min_k = max_k = top_k (entropy) and top_p = 1 with max_k = top_k select and weigh
  exactly what softmax_topk does: the weights a top-k model was trained with."""
  logits_TE = jax.random.normal(jax.random.key(2), (32, 8)) * 2
  kw = dict(top_k=2, renormalize=renormalize)
  want = routing.route(logits_TE, mode="softmax_topk", **kw)
  for got in (_entropy_route(logits_TE, min_k=2, max_k=2, threshold=0.3, renormalize=renormalize),
              routing.route(logits_TE, mode="top_p", top_p=1.0, max_k=2, **kw)):
    np.testing.assert_array_equal(got.expert_TK, want.expert_TK)
    np.testing.assert_array_equal(got.keep_TK, want.keep_TK)
    np.testing.assert_allclose(got.weight_TK, want.weight_TK, rtol=1e-6)
  # topk_softmax's weights are the chosen probs renormalized (what elastic.py asks for).
  tks = routing.route(logits_TE, mode="topk_softmax", top_k=2, renormalize=False)
  ent = _entropy_route(logits_TE, min_k=2, max_k=2, renormalize=True)
  np.testing.assert_allclose(ent.weight_TK, tks.weight_TK, rtol=1e-5)


def test_entropy_with_capacity_counts_only_used_slots():
  logits_TE = jnp.tile(jnp.array([[9.0, 0.0, 0.0, 0.0]]), (6, 1))   # confident: 1 expert
  r = _entropy_route(logits_TE, min_k=1, max_k=3, threshold=0.5, capacity=4)
  np.testing.assert_array_equal(r.selected_TK.sum(-1), 1)
  np.testing.assert_array_equal(r.keep_TK[:, 0], [1, 1, 1, 1, 0, 0])  # tokens 4, 5 dropped
  assert not bool(r.keep_TK[:, 1:].any())


def test_masked_slots_read_no_expert_weights():
  """The gmm path sorts unused slots to the pseudo-expert E, whose tiles read no weights:
  an expert chosen only by unused slots may hold NaNs without reaching the output."""
  T, D, F, E = 8, 16, 32, 4
  ks = jax.random.split(jax.random.key(3), 4)
  x_TD = jax.random.normal(ks[0], (T, D))
  logits_TE = jnp.tile(jnp.array([[9.0, 3.0, 0.0, -9.0]]), (T, 1))  # only expert 0 used
  r = _entropy_route(logits_TE, min_k=1, max_k=3, threshold=0.5)
  np.testing.assert_array_equal(r.selected_TK.sum(-1), 1)
  w = [jax.random.normal(k, s) * 0.3 for k, s in zip(ks[1:], [(E, D, F), (E, D, F), (E, F, D)])]
  poisoned = [wi.at[1:].set(jnp.nan) for wi in w]
  for impl in ("gmm", "blocked"):
    y = expert_ffn(impl, x_TD, r.expert_TK, r.weight_TK, r.keep_TK, *poisoned, capacity=T)
    ref = expert_ffn(impl, x_TD, r.expert_TK[:, :1], r.weight_TK[:, :1], r.keep_TK[:, :1], *w,
                     capacity=T)
    assert bool(jnp.isfinite(y).all()), impl
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides, message", [
    (["moe.routing=entropy", "moe.entropy_threshold=1.0"],
     "moe.entropy_threshold=1.0: must be in [0, 1)"),
    (["moe.routing=entropy", "moe.entropy_threshold=-0.1"], "moe.entropy_threshold=-0.1"),
    (["moe.routing=entropy", "moe.min_k=3", "moe.max_k=2"],
     "moe.min_k=3: must be in [1, moe.max_k=2]"),
    (["moe.routing=entropy", "moe.min_k=0"], "moe.min_k=0: must be in [1, moe.max_k=4]"),
    (["moe.routing=entropy", "moe.max_k=9"], "moe.max_k=9 exceeds moe.num_experts=8"),
    (["moe.routing=top_p", "moe.max_k=9"], "moe.max_k=9 exceeds moe.num_experts=8"),
    (["moe.routing=top_p", "moe.top_p=0"], "moe.top_p=0.0: must be in (0, 1]"),
    (["moe.routing=greedy"], "must be one of softmax_topk, topk_softmax, top_p, entropy"),
])
def test_elastic_config_errors(overrides, message):
  with pytest.raises(ConfigError, match=re.escape(message)):
    load_config(None, overrides)


def test_entropy_slots_and_defaults():
  moe = load_config(None, ["moe.routing=entropy", "moe.max_k=3"]).moe
  assert routing.slots_per_token(moe) == 3
  assert (moe.min_k, moe.entropy_threshold) == (1, 0.5)
  # Out-of-range entropy settings are not errors while another mode is used.
  load_config(None, ["moe.entropy_threshold=2", "moe.min_k=9"])


# ------------------------------------------------- decode through the model ---

# configs/tiny.yaml (layer 0 dense, top-2 softmax_topk of 8 experts) at test size.
TINY = ["model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
        "model.ffn_hidden=48", "moe.expert_hidden=32", "model.max_seq_len=64", "data.seq_len=32"]


def _tiny(*extra):
  return load_config("configs/tiny.yaml", TINY + list(extra))


@pytest.fixture(scope="module")
def trained():
  """A top-2 model whose router is sharpened (scaled), so tokens differ in entropy."""
  cfg = _tiny()
  model = build_model(cfg, 0)
  for b in model.blocks:
    if b.is_moe:
      b.ffn.router_DE[...] = b.ffn.router_DE[...] * 150.0
  _, params, buffers = split_model(model)
  return cfg, params, buffers


def _decode_logits(cfg, params, buffers, tokens_BT, prefill):
  """Logits of every position: prefill the first `prefill`, then one token per step; and
  the full forward without caches. Each call jitted (one trace per shape)."""
  from moejax.inference.generate import dense_caches
  graphdef = abstract_model(cfg)[0]

  @jax.jit
  def fwd(params, buffers, tok_BT, pos_BT, caches):
    logits, stats, caches = nnx.merge(graphdef, params, buffers)(tok_BT, pos_BT, caches)
    return logits, jnp.stack([s["experts_per_token"] for s in stats]), caches

  B, T = tokens_BT.shape
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  caches = dense_caches(cfg, B, T, dtype=jnp.float32)
  out, ept, caches = fwd(params, buffers, tokens_BT[:, :prefill], pos[:, :prefill], caches)
  outs, epts = [out], [ept]
  for t in range(prefill, T):
    out, ept, caches = fwd(params, buffers, tokens_BT[:, t:t + 1], pos[:, t:t + 1], caches)
    outs.append(out), epts.append(ept)
  full = fwd(params, buffers, tokens_BT, pos, None)[0]
  return jnp.concatenate(outs, axis=1), full, np.stack(epts)


@pytest.mark.parametrize("mode", [["moe.routing=top_p", "moe.top_p=0.6", "moe.max_k=3"],
                                  ["moe.routing=entropy", "moe.entropy_threshold=0.3",
                                   "moe.max_k=3"]])
def test_elastic_decode_matches_the_full_forward_and_varies_k(trained, mode):
  base, params, buffers = trained
  cfg = _tiny(*mode)
  tokens = jax.random.randint(jax.random.key(4), (2, 24), 0, 256, dtype=jnp.int32)
  step_logits, full_logits, ept = _decode_logits(cfg, params, buffers, tokens, prefill=8)
  np.testing.assert_allclose(step_logits, full_logits, rtol=1e-4, atol=1e-4)
  assert 1.0 <= ept.min() and ept.max() <= 3.0
  assert ept.min() < ept.max()           # decode steps differ in experts per token
  # ... and differs from the trained top-2 routing
  trained_logits = nnx.merge(abstract_model(base)[0], params, buffers)(tokens)[0]
  assert not np.allclose(full_logits, trained_logits, atol=1e-3)


def test_elastic_decode_at_the_trained_k_is_the_trained_model(trained):
  base, params, buffers = trained
  tokens = jax.random.randint(jax.random.key(5), (2, 16), 0, 256, dtype=jnp.int32)
  want = nnx.merge(abstract_model(base)[0], params, buffers)(tokens)[0]
  for mode in (["moe.routing=entropy", "moe.min_k=2", "moe.max_k=2"],
               ["moe.routing=top_p", "moe.top_p=1.0", "moe.max_k=2"]):
    step_logits, _, ept = _decode_logits(_tiny(*mode), params, buffers, tokens, prefill=4)
    np.testing.assert_allclose(step_logits, want, rtol=1e-4, atol=1e-4)
    if "moe.routing=entropy" in mode:
      np.testing.assert_array_equal(ept, 2.0)
    else:   # a sharp router's top prob rounds to 1.0: top_p = 1 is reached by one expert
      assert 1.0 <= ept.min() and ept.max() <= 2.0


def test_engine_generates_with_entropy_routing_on_gmm(trained):
  """The Engine's compiled decode loop with entropy routing and the gmm experts (the path
  that skips unused slots), against the blocked experts."""
  from moejax.inference import Engine, SamplingConfig
  _, params, buffers = trained
  out = {}
  for impl in ("blocked", "gmm"):
    cfg = _tiny("moe.routing=entropy", "moe.entropy_threshold=0.3", "moe.max_k=3",
                f"moe.expert_impl={impl}")
    engine = Engine(cfg, abstract_model(cfg)[0], params, buffers)
    (ids,), _ = engine.generate([[1, 2, 3, 4, 5]], 6, sampling=SamplingConfig(0.0))
    out[impl] = ids
  assert len(out["gmm"]) == 6 and out["gmm"] == out["blocked"]


@pytest.mark.parametrize("capacity", [None, 6])
def test_expert_impls_agree_under_entropy_routing(capacity):
  T, D, F, E = 24, 16, 24, 4
  ks = jax.random.split(jax.random.key(6), 5)
  x_TD = jax.random.normal(ks[0], (T, D))
  logits_TE = jax.random.normal(ks[1], (T, E)) * jnp.linspace(0.2, 5, T)[:, None]
  r = _entropy_route(logits_TE, min_k=1, max_k=3, threshold=0.5, capacity=capacity)
  assert 1 <= int(r.selected_TK.sum(-1).min()) < int(r.selected_TK.sum(-1).max()) <= 3
  w = [jax.random.normal(k, s) * 0.3 for k, s in zip(ks[2:], [(E, D, F), (E, D, F), (E, F, D)])]
  want = expert_ffn("dense", x_TD, r.expert_TK, r.weight_TK, r.keep_TK, *w, capacity=capacity or T)
  for impl in ("ragged", "blocked", "gmm"):
    got = expert_ffn(impl, x_TD, r.expert_TK, r.weight_TK, r.keep_TK, *w, capacity=capacity or T)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5, err_msg=impl)


def test_entropy_stats_of_split_token_groups_add_up():
  """Entropy routing is per token: the expert-parallel path's per-device sums give the
  whole batch's statistics (as test_routing checks for top_p)."""
  import chex
  logits = jax.random.normal(jax.random.key(7), (32, 8)) * 2
  kw = dict(min_k=1, max_k=3, threshold=0.6)
  whole = routing.load_stats(routing.stat_sums(_entropy_route(logits, **kw)), 32)
  groups = [routing.stat_sums(_entropy_route(g, **kw)) for g in jnp.split(logits, 4)]
  chex.assert_trees_all_close(routing.load_stats(jax.tree.map(lambda *v: sum(v), *groups), 32),
                              whole, rtol=1e-6)
