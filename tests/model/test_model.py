import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import load_config
from moejax.model.experts import expert_ffn
from moejax.model.routing import route
from moejax.state import forward_loss, init_state

SMALL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
         "model.head_dim=8", "model.ffn_hidden=48", "moe.expert_hidden=24", "moe.num_experts=4",
         "model.max_seq_len=32", "data.seq_len=16"]


def small_cfg(*extra):
  return load_config(None, SMALL + list(extra))


def _tokens(seed, B=2, T=12, V=256):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, V, dtype=jnp.int32)


def test_causal_masking_future_tokens_do_not_change_past_logits():
  cfg = small_cfg()
  graphdef, st = init_state(cfg)
  model = nnx.merge(graphdef, st.params, st.buffers)
  toks = _tokens(1)
  changed = toks.at[:, 7].set((toks[:, 7] + 1) % 256)
  a, _, _ = model(toks)
  b, _, _ = model(changed)
  np.testing.assert_allclose(a[:, :7], b[:, :7], atol=1e-5)
  assert not np.allclose(a[:, 7:], b[:, 7:], atol=1e-3)


def _random_routing_inputs(seed, T=40, D=16, F=24, E=4, K=2):
  ks = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(ks[0], (T, D))
  logits = jax.random.normal(ks[1], (T, E)) * 2
  w = lambda k, s: jax.random.normal(k, s) * 0.3
  return x, logits, w(ks[2], (E, D, F)), w(ks[3], (E, D, F)), w(ks[4], (E, F, D))


def _per_token_reference(x, r, wg, wu, wd):
  """Loop over (token, slot): the definition of the MoE output."""
  out = np.zeros(x.shape, np.float64)
  for t in range(x.shape[0]):
    for k in range(r.expert_TK.shape[1]):
      if not r.keep_TK[t, k]:
        continue
      e = int(r.expert_TK[t, k])
      h = jax.nn.silu(x[t] @ wg[e]) * (x[t] @ wu[e])
      out[t] += float(r.weight_TK[t, k]) * np.asarray(h @ wd[e], np.float64)
  return out


@pytest.mark.parametrize("impl", ["dense", "ragged", "blocked", "gmm"])
@pytest.mark.parametrize("capacity", [None, 12])
def test_expert_impls_match_per_token_definition(impl, capacity):
  x, logits, wg, wu, wd = _random_routing_inputs(0)
  r = route(logits, mode="softmax_topk", top_k=2, renormalize=True, capacity=capacity)
  if capacity:
    assert int((~r.keep_TK).sum()) > 0  # the case really drops something
  y = expert_ffn(impl, x, r.expert_TK, r.weight_TK, r.keep_TK, wg, wu, wd,
                 capacity=capacity or x.shape[0])
  np.testing.assert_allclose(y, _per_token_reference(x, r, wg, wu, wd), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("extra", [[], ["moe.capacity_factor=1.0"],
                                   pytest.param(["moe.routing=top_p"], marks=pytest.mark.slow),
                                   ["moe.num_shared_experts=1", "moe.bias_balancing=true"]])
def test_expert_impls_give_same_loss_and_gradients(extra):
  grads = {}
  toks = _tokens(2, T=16)
  for impl in ("dense", "ragged", "blocked", "gmm"):
    cfg = small_cfg(f"moe.expert_impl={impl}", *extra)
    graphdef, st = init_state(cfg)
    f = lambda p: forward_loss(cfg, graphdef, p, st.buffers, toks[:, :-1], toks[:, 1:])
    (loss, metrics), g = jax.value_and_grad(f, has_aux=True)(st.params)
    grads[impl] = (loss, g)
  la, ga = grads["dense"]
  for impl in ("ragged", "blocked", "gmm"):
    lb, gb = grads[impl]
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
      np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-6)


def test_gradients_reach_router_and_experts():
  cfg = small_cfg()
  graphdef, st = init_state(cfg)
  toks = _tokens(3, T=16)
  f = lambda p: forward_loss(cfg, graphdef, p, st.buffers, toks[:, :-1], toks[:, 1:])[0]
  g = jax.grad(f)(st.params)
  moe = g["blocks"][0]["ffn"]
  for name in ("router_DE", "w_gate_EDF", "w_up_EDF", "w_down_EFD"):
    assert float(jnp.abs(moe[name][...]).sum()) > 0, name
  # Each expert that received tokens gets a gradient.
  assert int((jnp.abs(moe["w_down_EFD"][...]).sum(axis=(1, 2)) > 0).sum()) >= 2


def test_moe_every_and_first_dense_layers_build_the_right_blocks():
  cfg = small_cfg("model.num_layers=4", "moe.first_dense_layers=1", "moe.moe_every=2")
  graphdef, st = init_state(cfg)
  model = nnx.merge(graphdef, st.params, st.buffers)
  assert model.moe_layers == [1, 3]


def test_untied_head_and_bf16_compute_run():
  cfg = small_cfg("model.tie_embeddings=false", "model.dtype=bfloat16")
  graphdef, st = init_state(cfg)
  loss, _ = forward_loss(cfg, graphdef, st.params, st.buffers, _tokens(4)[:, :-1], _tokens(4)[:, 1:])
  assert np.isfinite(float(loss))
  assert abs(float(loss) - np.log(256)) < 1.0  # near-uniform at init


def test_model_does_not_import_parallel():
  """parallel -> model only: the model learns of expert parallelism through its `ep`."""
  import subprocess
  import sys
  code = ("import sys, moejax.state, moejax.inference; "
          "print(sorted(m for m in sys.modules if m.startswith('moejax.parallel')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]", out.stdout


class _RecordingEP:
  """Stands in for parallel.ExpertParallel: the same call, computed on one device."""

  def __init__(self):
    self.calls = []

  def __call__(self, cfg, x_TD, router_DE, bias_E, w_gate_EDF, w_up_EDF, w_down_EFD):
    from moejax.model import routing
    self.calls.append(x_TD.shape)
    r = routing.route_tokens(cfg, x_TD, router_DE, bias_E)
    y_TD = expert_ffn(cfg.expert_impl, x_TD, r.expert_TK, r.weight_TK, r.keep_TK, w_gate_EDF,
                      w_up_EDF, w_down_EFD, capacity=x_TD.shape[0])
    return y_TD, routing.load_stats(routing.stat_sums(r), x_TD.shape[0])


def test_moe_layers_dispatch_through_the_ep_the_model_is_built_with():
  from moejax.state import build_model, split_model
  cfg = small_cfg("moe.bias_balancing=true")
  ep = _RecordingEP()
  plain, parallel = build_model(cfg, 0), build_model(cfg, 0, ep)
  toks = _tokens(5)
  a, stats_a, _ = plain(toks)
  b, stats_b, _ = parallel(toks)
  assert ep.calls == [(2 * 12, 32)] * 2              # both MoE layers, the whole batch
  np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(stats_a, stats_b, rtol=1e-5, atol=1e-6)
  # The ep is static structure: parameters and router biases (what checkpoints hold) are
  # the same trees with or without it.
  for x, y in zip(split_model(plain)[1:], split_model(parallel)[1:]):
    chex.assert_trees_all_equal_structs(x, y)
    chex.assert_trees_all_equal(x, y)


def test_transformer_checks_its_inputs():
  graphdef, st = init_state(small_cfg())
  model = nnx.merge(graphdef, st.params, st.buffers)
  with pytest.raises(AssertionError, match="rank"):
    model(jnp.zeros((12,), jnp.int32))                 # tokens need [B, T]
  with pytest.raises(AssertionError):
    model(jnp.zeros((2, 12), jnp.float32))             # token ids are integers
  with pytest.raises(AssertionError):
    model(_tokens(0), jnp.zeros((2, 5), jnp.int32))    # positions must match the tokens


def test_fused_gate_up_equals_separate_and_is_used_only_where_weights_are_cast(monkeypatch):
  x, logits, wg, wu, wd = _random_routing_inputs(0)
  r = route(logits, mode="softmax_topk", top_k=2, renormalize=True, capacity=None)
  def loss(fuse):
    return lambda x, wg, wu, wd: jnp.sum(expert_ffn(
        "gmm", x, r.expert_TK, r.weight_TK, r.keep_TK, wg, wu, wd, capacity=x.shape[0],
        fuse_gate_up=fuse) ** 2)
  got = {f: jax.value_and_grad(loss(f), argnums=(0, 1, 2, 3))(x, wg, wu, wd) for f in (0, 1)}
  np.testing.assert_allclose(got[1][0], got[0][0], rtol=1e-6)
  for a, b in zip(got[1][1], got[0][1]):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  concats = lambda f: str(jax.make_jaxpr(loss(f))(x, wg, wu, wd)).count("concatenate")
  assert concats(True) > concats(False)                     # the [E, D, 2F] weights
  # The model fuses when float32 parameters are cast to a 16-bit compute dtype (training),
  # not when they are stored in the compute dtype (the decode layout).
  from moejax.model import experts
  from moejax.state import build_model
  fused = []
  real = experts._fused_gate_up
  monkeypatch.setattr(experts, "_fused_gate_up", lambda *a: fused.append(1) or real(*a))
  for dtypes, want in ((["model.dtype=bfloat16"], True), ([], False)):
    fused.clear()
    build_model(small_cfg("moe.expert_impl=gmm", *dtypes), 0)(_tokens(2))
    assert bool(fused) == want, dtypes
