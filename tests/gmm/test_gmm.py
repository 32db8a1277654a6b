"""pallas_kernels.gmm / tgmm, every implementation that runs on a CPU, vs gmm/reference.py.

"triton" runs in Pallas interpret mode, "tpu" in Pallas' TPU interpret mode, "xla" as is.
Also: how an implementation is chosen (names, lists, configs, the default order).
"""
from __future__ import annotations

import importlib

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import _implementation
from pallas_kernels.gmm import reference
from pallas_kernels.gmm.plan import TpuConfig, TritonConfig

api = importlib.import_module("pallas_kernels.gmm.api")  # pk.gmm is the function

IMPLS = ("triton", "xla", "tpu")
# Small tiles so that the test shapes span several of them (the TPU's lanes are 128 wide).
CONFIGS = {
    "triton": TritonConfig(bm=16, bk=16, bn=16, split_k=1, group_m=8, num_warps=4,
                           num_stages=3, expert_major=False),
    "tpu": TpuConfig(bm=16, bk=128, bn=128),
    "xla": None,
}


class ref:  # the references, jitted (one compile instead of many eager ops)
  gmm = staticmethod(jax.jit(reference.gmm, static_argnums=(3, 4)))
  tgmm = staticmethod(jax.jit(reference.tgmm, static_argnums=(3,)))


def run(impl, x, w, gs, **kw):
  return pk.gmm(x, w, gs, implementation=impl, config=CONFIGS[impl], interpret=True, **kw)


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def random_sizes(rng, m, e):
  """Random group sizes with some zeros and sum < m (rows past the groups)."""
  total = m - int(rng.integers(1, max(2, m // 4)))
  cuts = np.sort(rng.integers(0, total + 1, e - 1))
  sizes = np.diff(np.concatenate([[0], cuts, [total]]))
  sizes[rng.random(e) < 0.3] = 0  # more empty groups; sum shrinks, tail grows
  return jnp.asarray(sizes, jnp.int32)


def inputs(seed, m, i, o, e, dtype=jnp.float32):
  kx, kw = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (m, i), dtype), jax.random.normal(kw, (e, i, o), dtype)


# --- forward -----------------------------------------------------------------------


@pytest.mark.parametrize("impl,e", [("triton", 1), ("triton", 8), ("triton", 64), ("tpu", 1),
                                    ("tpu", 64), ("xla", 64)])
def test_gmm_matches_reference(impl, e):
  rng = np.random.default_rng(e)
  m, i, o = 45, 40, 36  # none a multiple of the tiles
  x, w = inputs(e, m, i, o, e)
  gs = random_sizes(rng, m, e)
  out = run(impl, x, w, gs)
  assert out.shape == (m, o) and out.dtype == jnp.float32
  assert rel_err(out, ref.gmm(x, w, gs)) < 1e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_past_the_groups_are_zero(impl):
  m, i, o, e = 50, 32, 32, 4
  x, w = inputs(0, m, i, o, e)
  x = x.at[30:].set(1e4)  # large values in the tail must not leak
  gs = jnp.asarray([10, 0, 15, 5], jnp.int32)
  out = run(impl, x, w, gs)
  assert bool(jnp.all(out[30:] == 0))
  assert bool(jnp.all(jnp.any(out[:30] != 0, axis=1)))
  assert rel_err(out, ref.gmm(x, w, gs)) < 1e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_all_groups_empty_and_sizes_past_m(impl):
  m, i, o, e = 30, 16, 16, 3
  x, w = inputs(70, m, i, o, e)
  assert bool(jnp.all(run(impl, x, w, jnp.zeros((e,), jnp.int32)) == 0))
  gs = jnp.asarray([12, 10, 25], jnp.int32)  # sum 47 > 30: the last group gets 8 rows
  want = ref.gmm(x, w, jnp.asarray([12, 10, 8], jnp.int32))
  assert rel_err(run(impl, x, w, gs), want) < 1e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_inputs_and_preferred_element_type(impl):
  rng = np.random.default_rng(3)
  m, i, o, e = 37, 48, 40, 5
  x, w = inputs(3, m, i, o, e, jnp.bfloat16)
  gs = random_sizes(rng, m, e)
  out = run(impl, x, w, gs, preferred_element_type=jnp.float32)
  assert out.dtype == jnp.float32
  assert rel_err(out, ref.gmm(x, w, gs, jnp.float32)) < 1e-5  # f32 accumulation
  assert run(impl, x, w, gs).dtype == jnp.bfloat16


@pytest.mark.parametrize("config", [
    TritonConfig(bm=16, bk=16, bn=16, split_k=2, group_m=8, expert_major=False),
    TritonConfig(bm=32, bk=16, bn=32, split_k=4, group_m=2, expert_major=True),
    TritonConfig(bm=16, bn=16),  # the rest from the heuristic
])
def test_triton_configs_agree(config):
  rng = np.random.default_rng(7)
  m, i, o, e = 40, 72, 33, 6
  x, w = inputs(7, m, i, o, e)
  gs = random_sizes(rng, m, e)
  out = pk.gmm(x, w, gs, implementation="triton", config=config, interpret=True)
  assert rel_err(out, ref.gmm(x, w, gs)) < 1e-5


@pytest.mark.parametrize("impl", ["triton", "xla"])
def test_decode_rows_with_default_config(impl):
  """A few routed rows (decode): triton's default is the split-reduction, expert-major one."""
  m, i, o, e = 3, 64, 48, 8
  x, w = inputs(11, m, i, o, e)
  gs = jnp.asarray([0, 1, 0, 0, 2, 0, 0, 0], jnp.int32)
  assert pk.default_tiling(m, i, o, e).expert_major
  assert rel_err(pk.gmm(x, w, gs, implementation=impl), ref.gmm(x, w, gs)) < 1e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_under_jit_with_traced_group_sizes(impl):
  m, i, o, e = 33, 16, 16, 4
  x, w = inputs(9, m, i, o, e)
  f = jax.jit(lambda x, w, gs: run(impl, x, w, gs))
  for sizes in ([0, 33, 0, 0], [1, 0, 2, 3]):
    gs = jnp.asarray(sizes, jnp.int32)
    assert rel_err(f(x, w, gs), ref.gmm(x, w, gs)) < 1e-5


@hypothesis.settings(max_examples=2, deadline=None)
@hypothesis.given(
    m=st.integers(1, 40), i=st.integers(1, 40), o=st.integers(1, 40), e=st.integers(1, 6),
    seed=st.integers(0, 1 << 16))
def test_triton_random_shapes(m, i, o, e, seed):
  rng = np.random.default_rng(seed)
  x, w = inputs(seed, m, i, o, e)
  gs = jnp.asarray(rng.multinomial(int(rng.integers(0, m + 1)), np.ones(e) / e), jnp.int32)
  assert rel_err(run("triton", x, w, gs), ref.gmm(x, w, gs)) < 1e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_inputs(impl):
  w = jnp.ones((2, 8, 4))
  sizes = jnp.zeros((2,), jnp.int32)
  kw = dict(implementation=impl, interpret=True)
  assert pk.gmm(jnp.ones((0, 8)), w, sizes, **kw).shape == (0, 4)
  assert pk.tgmm(jnp.ones((8, 0)), jnp.ones((0, 4)), sizes, **kw).shape == (2, 8, 4)


# --- gradients and tgmm ---------------------------------------------------------------


# tpu: test_on_a_tpu_the_default_takes_the_tpu_kernels_forward_and_backward.
@pytest.mark.parametrize("impl,e", [("triton", 1), ("triton", 64), ("xla", 8)])
def test_gradients_match_reference(impl, e):
  rng = np.random.default_rng(100 + e)
  m, i, o = 39, 24, 20
  x, w = inputs(100 + e, m, i, o, e)
  gs = random_sizes(rng, m, e)
  dy = jax.random.normal(jax.random.key(5), (m, o))

  def loss(f):
    return lambda x, w: jnp.sum(f(x, w) * dy)

  gx, gw = jax.grad(loss(lambda x, w: run(impl, x, w, gs)), (0, 1))(x, w)
  rx, rw = jax.grad(loss(lambda x, w: ref.gmm(x, w, gs)), (0, 1))(x, w)
  chex.assert_trees_all_close((gx, gw), (rx, rw), rtol=1e-5, atol=1e-4)
  assert bool(jnp.all(gw[np.asarray(gs) == 0] == 0))  # unrouted experts get zero gradient


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("e", [1, 7])
def test_tgmm_matches_reference(impl, e):
  rng = np.random.default_rng(20 + e)
  m, i, o = 41, 24, 36
  a = jax.random.normal(jax.random.key(1), (i, m))
  b = jax.random.normal(jax.random.key(2), (m, o))
  gs = random_sizes(rng, m, e)
  out = pk.tgmm(a, b, gs, implementation=impl, config=CONFIGS[impl], interpret=True)
  assert out.shape == (e, i, o)
  assert rel_err(out, ref.tgmm(a, b, gs)) < 1e-5
  assert bool(jnp.all(out[np.asarray(gs) == 0] == 0))


# --- choosing an implementation --------------------------------------------------------


def kernels_run(f, *args) -> set[str]:
  """Names of the pallas_calls in f's jaxpr (sub-jaxprs included); empty: XLA ops only."""
  names = set()

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        info = eqn.params.get("name_and_src_info")
        names.add(getattr(info, "name", None) or eqn.params.get("name"))
      for p in eqn.params.values():
        for sub in p if isinstance(p, (tuple, list)) else (p,):
          if isinstance(sub, jax.extend.core.ClosedJaxpr):
            walk(sub.jaxpr)
          elif isinstance(sub, jax.extend.core.Jaxpr):
            walk(sub)

  walk(jax.make_jaxpr(f)(*args).jaxpr)
  return names


def test_default_order_by_platform(monkeypatch):
  monkeypatch.setattr(_implementation, "platform", lambda: "tpu")
  assert api._default_order() == ("tpu", "xla")
  monkeypatch.setattr(_implementation, "platform", lambda: "gpu")
  assert api._default_order() == ("triton", "xla")
  monkeypatch.setattr(_implementation, "platform", lambda: "cpu")
  assert api._default_order() == ("triton", "xla")
  x, w = inputs(0, 20, 16, 16, 2)
  gs = jnp.asarray([5, 9], jnp.int32)
  assert kernels_run(lambda x, w: pk.gmm(x, w, gs), x, w) == {"gmm"}  # CPU: triton


def test_on_a_tpu_the_default_takes_the_tpu_kernels_forward_and_backward(monkeypatch):
  monkeypatch.setattr(_implementation, "platform", lambda: "tpu")
  rng = np.random.default_rng(60)
  m, i, o, e = 70, 130, 140, 6
  x, w = inputs(60, m, i, o, e)
  gs = random_sizes(rng, m, e)
  dy = jax.random.normal(jax.random.key(61), (m, o))
  f = lambda x, w: jnp.sum(pk.gmm(x, w, gs, interpret=True) * dy)  # noqa: E731
  assert kernels_run(jax.grad(f, (0, 1)), x, w) == {"gmm_tpu", "tgmm_tpu"}
  gx, gw = jax.grad(f, (0, 1))(x, w)
  rx, rw = jax.grad(lambda x, w: jnp.sum(ref.gmm(x, w, gs) * dy), (0, 1))(x, w)
  assert rel_err(gx, rx) < 1e-5 and rel_err(gw, rw) < 1e-5


def test_list_falls_back_when_the_first_is_unsupported():
  x, w = inputs(1, 20, 16, 16, 2)
  gs = jnp.asarray([5, 9], jnp.int32)
  # On a CPU without interpret mode neither Pallas kernel compiles: xla runs.
  f = lambda x, w: pk.gmm(x, w, gs, implementation=["tpu", "triton", "xla"],  # noqa: E731
                          interpret=False)
  assert kernels_run(f, x, w) == set()
  assert rel_err(f(x, w), ref.gmm(x, w, gs)) < 1e-5
  a, b = jnp.swapaxes(x, 0, 1), jax.random.normal(jax.random.key(3), (20, 16))
  out = pk.tgmm(a, b, gs, implementation=("tpu", "xla"), interpret=False)
  assert rel_err(out, ref.tgmm(a, b, gs)) < 1e-5


def test_unsupported_everywhere_lists_the_reasons():
  x, w = inputs(1, 20, 16, 16, 2)
  gs = jnp.asarray([5, 9], jnp.int32)
  with pytest.raises(_implementation.Unsupported, match="tpu: compiles for TPUs only.*"
                     "triton: compiles for GPUs only"):
    pk.gmm(x, w, gs, implementation=("tpu", "triton"), interpret=False)


@pytest.mark.parametrize("kw,match", [
    (dict(implementation="cuda"), "unknown implementation 'cuda'; choose from triton, tpu, xla"),
    (dict(implementation=["xla", "mosaic"]), "unknown implementation 'mosaic'"),
    (dict(implementation=()), "at least one"),
    (dict(implementation="xla", config=TritonConfig()), "TritonConfig belongs to none"),
    (dict(implementation="triton", config=TpuConfig()), "TpuConfig belongs to none"),
    (dict(config=(16, 16, 16)), "tuple belongs to none"),
])
def test_bad_selection_raises(kw, match):
  x, w = inputs(1, 20, 16, 16, 2)
  gs = jnp.asarray([5, 9], jnp.int32)
  with pytest.raises(ValueError, match=match):
    pk.gmm(x, w, gs, interpret=True, **kw)
  with pytest.raises(ValueError, match=match):
    pk.tgmm(jnp.swapaxes(x, 0, 1), x, gs, interpret=True, **kw)


def test_config_goes_to_its_implementation_in_a_list():
  x, w = inputs(2, 20, 16, 16, 2)
  gs = jnp.asarray([5, 9], jnp.int32)
  # tpu (first) runs with its default config; the TritonConfig is for triton only.
  f = lambda x, w: pk.gmm(x, w, gs, implementation=("tpu", "triton"),  # noqa: E731
                          config=CONFIGS["triton"], interpret=True)
  assert kernels_run(f, x, w) == {"gmm_tpu"}


# --- input checks -----------------------------------------------------------------------


@pytest.mark.parametrize("call,match", [
    (lambda: pk.gmm(jnp.ones(8), jnp.ones((2, 8, 4)), jnp.ones(2, jnp.int32)), "lhs must be"),
    (lambda: pk.gmm(jnp.ones((3, 8)), jnp.ones((8, 4)), jnp.ones(2, jnp.int32)), "rhs must be"),
    (lambda: pk.gmm(jnp.ones((3, 7)), jnp.ones((2, 8, 4)), jnp.ones(2, jnp.int32)), "I=7"),
    (lambda: pk.gmm(jnp.ones((3, 8)), jnp.ones((2, 8, 4)), jnp.ones(3, jnp.int32)), "E=2"),
    (lambda: pk.gmm(jnp.ones((3, 8)), jnp.ones((2, 8, 4)), jnp.ones(2)), "integer"),
    (lambda: pk.gmm(jnp.ones((3, 8), jnp.int32), jnp.ones((2, 8, 4)), jnp.ones(2, jnp.int32)),
     "floating"),
    (lambda: pk.tgmm(jnp.ones((8, 3)), jnp.ones((4, 5)), jnp.ones(2, jnp.int32)), "M=3"),
    (lambda: pk.tgmm(jnp.ones((8, 3)), jnp.ones((3, 5)), jnp.ones((2, 1), jnp.int32)),
     "group_sizes must be"),
])
def test_bad_input_raises(call, match):
  with pytest.raises(ValueError, match=match):
    call()


@pytest.mark.slow
def test_bench_script_smoke(tmp_path):
  """experiments/bench_gmm.py --smoke runs (tiny sizes, interpret mode) and writes JSON."""
  import json
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  subprocess.run([sys.executable, os.path.join(root, "experiments", "bench_gmm.py"), "--smoke",
                  "--cases", "check,c", "--no-bwd", "--out", str(tmp_path)],
                 check=True, capture_output=True, timeout=600)
  res = json.loads((tmp_path / "bench_gmm.json").read_text())
  assert all(c["ok"] for c in res["checks"]) and res["rows"]
