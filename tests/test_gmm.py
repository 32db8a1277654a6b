"""pallas_kernels.gmm (interpret mode on CPU) vs the plain jnp reference."""
from __future__ import annotations

import dataclasses

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import reference
from pallas_kernels.gmm_plan import GmmTiling, make_tile_metadata, num_work_tiles

SMALL = GmmTiling(bm=16, bk=16, bn=16)


class ref:  # the references, jitted (one compile instead of many eager ops)
  gmm = staticmethod(jax.jit(reference.gmm, static_argnums=(3, 4)))
  tgmm = staticmethod(jax.jit(reference.tgmm, static_argnums=(3,)))


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def random_sizes(rng, m, e, *, tail=True):
  """Random group sizes with some zeros; sum < m when tail (rows past the groups)."""
  total = m - int(rng.integers(1, max(2, m // 4))) if tail else m
  cuts = np.sort(rng.integers(0, total + 1, e - 1))
  sizes = np.diff(np.concatenate([[0], cuts, [total]]))
  sizes[rng.random(e) < 0.3] = 0  # more empty groups; sum shrinks, tail grows
  return jnp.asarray(sizes, jnp.int32)


def inputs(seed, m, k, n, e, dtype=jnp.float32):
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (m, k), dtype)
  w = jax.random.normal(kw, (e, k, n), dtype)
  return x, w


@pytest.mark.parametrize("e", [1, 8, 64])
def test_gmm_matches_reference(e):
  rng = np.random.default_rng(e)
  m, k, n = 45, 40, 36  # none a multiple of the 16-wide tiles
  x, w = inputs(e, m, k, n, e)
  gs = random_sizes(rng, m, e)
  out = pk.gmm(x, w, gs, tiling=SMALL)
  assert out.shape == (m, n) and out.dtype == jnp.float32
  assert rel_err(out, ref.gmm(x, w, gs)) < 1e-5


def test_rows_past_the_groups_are_zero():
  m, k, n, e = 50, 32, 32, 4
  x, w = inputs(0, m, k, n, e)
  x = x.at[30:].set(1e4)  # large values in the tail must not leak
  gs = jnp.asarray([10, 0, 15, 5], jnp.int32)
  out = pk.gmm(x, w, gs, tiling=SMALL)
  assert bool(jnp.all(out[30:] == 0))
  assert bool(jnp.all(jnp.any(out[:30] != 0, axis=1)))
  assert rel_err(out, ref.gmm(x, w, gs)) < 1e-5


def test_all_groups_empty_gives_zeros():
  x, w = inputs(1, 20, 16, 16, 3)
  out = pk.gmm(x, w, jnp.zeros((3,), jnp.int32), tiling=SMALL)
  assert bool(jnp.all(out == 0))


def test_bf16_inputs_and_preferred_element_type():
  rng = np.random.default_rng(3)
  m, k, n, e = 37, 48, 40, 5
  x, w = inputs(3, m, k, n, e, jnp.bfloat16)
  gs = random_sizes(rng, m, e)
  out = pk.gmm(x, w, gs, preferred_element_type=jnp.float32, tiling=SMALL)
  assert out.dtype == jnp.float32
  assert rel_err(out, ref.gmm(x, w, gs, jnp.float32)) < 1e-5  # f32 accumulation
  assert pk.gmm(x, w, gs, tiling=SMALL).dtype == jnp.bfloat16


@pytest.mark.parametrize("tiling", [
    GmmTiling(bm=16, bk=16, bn=16, split_k=2),
    GmmTiling(bm=32, bk=16, bn=32, split_k=4, group_m=2, expert_major=True),
])
def test_tilings_agree(tiling):
  rng = np.random.default_rng(7)
  m, k, n, e = 40, 72, 33, 6
  x, w = inputs(7, m, k, n, e)
  gs = random_sizes(rng, m, e)
  assert rel_err(pk.gmm(x, w, gs, tiling=tiling), ref.gmm(x, w, gs)) < 1e-5


def test_decode_rows():
  """A few routed rows (decode): the default tiling is the split-K, expert-major one."""
  m, k, n, e = 3, 64, 48, 8
  x, w = inputs(11, m, k, n, e)
  gs = jnp.asarray([0, 1, 0, 0, 2, 0, 0, 0], jnp.int32)
  assert pk.default_tiling(m, k, n, e).expert_major
  assert rel_err(pk.gmm(x, w, gs), ref.gmm(x, w, gs)) < 1e-5


@pytest.mark.parametrize("e", [1, 8, 64])
def test_gradients_match_reference(e):
  rng = np.random.default_rng(100 + e)
  m, k, n = 39, 24, 20
  x, w = inputs(100 + e, m, k, n, e)
  gs = random_sizes(rng, m, e)
  dy = jax.random.normal(jax.random.key(5), (m, n))

  def loss(f):
    return lambda x, w: jnp.sum(f(x, w) * dy)

  gx, gw = jax.grad(loss(lambda x, w: pk.gmm(x, w, gs)), (0, 1))(x, w)
  rx, rw = jax.grad(loss(lambda x, w: ref.gmm(x, w, gs)), (0, 1))(x, w)
  assert rel_err(gx, rx) < 1e-5
  assert rel_err(gw, rw) < 1e-5
  empty = np.asarray(gs) == 0
  assert bool(jnp.all(gw[empty] == 0))  # unrouted experts get zero gradient


def test_gmm_under_jit_with_traced_group_sizes():
  m, k, n, e = 33, 16, 16, 4
  x, w = inputs(9, m, k, n, e)
  f = jax.jit(lambda x, w, gs: pk.gmm(x, w, gs, tiling=SMALL))
  for sizes in ([8, 8, 8, 8], [0, 33, 0, 0], [1, 0, 2, 3]):
    gs = jnp.asarray(sizes, jnp.int32)
    assert rel_err(f(x, w, gs), ref.gmm(x, w, gs)) < 1e-5


@pytest.mark.parametrize("e", [1, 7])
def test_tgmm_matches_reference(e):
  rng = np.random.default_rng(20 + e)
  m, k, n = 41, 24, 36
  a = jax.random.normal(jax.random.key(1), (k, m))
  b = jax.random.normal(jax.random.key(2), (m, n))
  gs = random_sizes(rng, m, e)
  out = pk.tgmm(a, b, gs, tiling=SMALL)
  assert out.shape == (e, k, n)
  assert rel_err(out, ref.tgmm(a, b, gs)) < 1e-5
  assert bool(jnp.all(out[np.asarray(gs) == 0] == 0))


@pytest.mark.parametrize("bits,group_size", [(8, None), (4, None), (8, 16), (4, 16)])
def test_quantized_matches_dequantize_then_matmul(bits, group_size):
  rng = np.random.default_rng(bits)
  m, k, n, e = 35, 64, 40, 5
  x, w = inputs(30 + bits, m, k, n, e)
  gs = random_sizes(rng, m, e)
  q = pk.quantize_expert_weights(w, bits=bits, group_size=group_size)
  assert q.shape == (e, k, n)
  assert q.codes.shape == (e, k // 2 if bits == 4 else k, n)
  out = pk.gmm(x, q, gs, tiling=SMALL)
  want = ref.gmm(x, pk.dequantize_expert_weights(q), gs)
  assert rel_err(out, want) < 1e-5
  assert bool(jnp.all(out[int(gs.sum()):] == 0))


def test_quantized_gradient_wrt_lhs():
  rng = np.random.default_rng(4)
  m, k, n, e = 30, 32, 24, 4
  x, w = inputs(44, m, k, n, e)
  gs = random_sizes(rng, m, e)
  q = pk.quantize_expert_weights(w, bits=4)
  wd = pk.dequantize_expert_weights(q)
  gx = jax.grad(lambda x: jnp.sum(pk.gmm(x, q, gs, tiling=SMALL) ** 2))(x)
  rx = jax.grad(lambda x: jnp.sum(ref.gmm(x, wd, gs) ** 2))(x)
  assert rel_err(gx, rx) < 1e-5


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_error_is_at_most_half_a_step(bits):
  w = jax.random.normal(jax.random.key(bits), (3, 32, 16))
  q = pk.quantize_expert_weights(w, bits=bits, group_size=8)
  step = jnp.repeat(q.scales, 8, axis=1)
  assert bool(jnp.all(jnp.abs(pk.dequantize_expert_weights(q) - w) <= step / 2 + 1e-6))
  assert q.nbytes == q.codes.size * q.codes.dtype.itemsize + q.scales.size * 4
  leaves, treedef = jax.tree_util.tree_flatten(q)
  assert len(leaves) == 2 and jax.tree_util.tree_unflatten(treedef, leaves).bits == bits


@hypothesis.settings(max_examples=15, deadline=None)
@hypothesis.given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    extra=st.integers(0, 20), bm=st.sampled_from([8, 16, 64]), visit_empty=st.booleans())
def test_work_tiles_cover_every_row_once(sizes, extra, bm, visit_empty):
  m = sum(sizes) + extra
  hypothesis.assume(m > 0)
  e = len(sizes)
  meta = jax.tree.map(np.asarray, make_tile_metadata(
      jnp.asarray(sizes, jnp.int32), m, bm, visit_empty))
  assert meta.group_W.shape[0] == num_work_tiles(m, bm, e, visit_empty)
  assert np.all((meta.mtile_W >= 0) & (meta.mtile_W * bm < m))
  if visit_empty:  # every real group has a work tile, in group order
    assert set(range(e)) <= set(meta.group_W.tolist())
    assert np.all(np.diff(meta.group_W) >= 0)
  owner = np.full(m, -1)
  ends = np.cumsum(sizes)
  for g, mt, lo, hi in zip(meta.group_W, meta.mtile_W, meta.lo_W, meta.hi_W):
    if lo >= hi:
      continue
    assert mt * bm <= lo and hi <= (mt + 1) * bm  # rows inside the row tile
    assert np.all(owner[lo:hi] == -1)  # no row twice
    owner[lo:hi] = g
  want = np.searchsorted(ends, np.arange(m), side="right")  # E for the tail
  assert np.array_equal(owner, want)
  used = {g for g, lo, hi in zip(meta.group_W, meta.lo_W, meta.hi_W) if lo < hi}
  assert all(sizes[g] > 0 for g in used if g < e)  # empty groups own no tiles


@hypothesis.settings(max_examples=3, deadline=None)
@hypothesis.given(
    m=st.integers(1, 40), k=st.integers(1, 40), n=st.integers(1, 40), e=st.integers(1, 6),
    seed=st.integers(0, 1 << 16))
def test_gmm_random_shapes(m, k, n, e, seed):
  rng = np.random.default_rng(seed)
  x, w = inputs(seed, m, k, n, e)
  sizes = rng.multinomial(int(rng.integers(0, m + 1)), np.ones(e) / e)
  gs = jnp.asarray(sizes, jnp.int32)
  assert rel_err(pk.gmm(x, w, gs, tiling=SMALL), ref.gmm(x, w, gs)) < 1e-5


def test_empty_inputs():
  w = jnp.ones((2, 8, 4))
  assert pk.gmm(jnp.ones((0, 8)), w, jnp.zeros((2,), jnp.int32)).shape == (0, 4)
  assert pk.tgmm(jnp.ones((8, 0)), jnp.ones((0, 4)), jnp.zeros((2,), jnp.int32)).shape == (2, 8, 4)


@pytest.mark.parametrize("call,match", [
    (lambda: pk.gmm(jnp.ones(8), jnp.ones((2, 8, 4)), jnp.ones(2, jnp.int32)), "lhs must be"),
    (lambda: pk.gmm(jnp.ones((3, 8)), jnp.ones((8, 4)), jnp.ones(2, jnp.int32)), "rhs must be"),
    (lambda: pk.gmm(jnp.ones((3, 7)), jnp.ones((2, 8, 4)), jnp.ones(2, jnp.int32)), "K=7"),
    (lambda: pk.gmm(jnp.ones((3, 8)), jnp.ones((2, 8, 4)), jnp.ones(3, jnp.int32)), "E=2"),
    (lambda: pk.gmm(jnp.ones((3, 8)), jnp.ones((2, 8, 4)), jnp.ones(2)), "integer"),
    (lambda: pk.gmm(jnp.ones((3, 8), jnp.int32), jnp.ones((2, 8, 4)), jnp.ones(2, jnp.int32)),
     "floating"),
    (lambda: pk.gmm(jnp.ones((3, 8)), jnp.ones((2, 8, 4)), jnp.ones(2, jnp.int32),
                    tiling=(16, 16, 16)), "GmmTiling"),
    (lambda: GmmTiling(bm=24), "power of two"),
    (lambda: pk.tgmm(jnp.ones((8, 3)), jnp.ones((4, 5)), jnp.ones(2, jnp.int32)), "M=3"),
    (lambda: pk.quantize_expert_weights(jnp.ones((2, 8, 4)), bits=3), "bits"),
    (lambda: pk.quantize_expert_weights(jnp.ones((2, 7, 4)), bits=4), "even"),
    (lambda: pk.quantize_expert_weights(jnp.ones((2, 8, 4)), bits=4, group_size=3), "divide"),
])
def test_bad_input_raises(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_tiling_is_a_frozen_dataclass():
  t = dataclasses.replace(SMALL, split_k=2)
  assert t.split_k == 2 and hash(t) != hash(SMALL)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_tpu_shaped_path_in_tpu_interpret_mode(transpose_rhs):
  from pallas_kernels.gmm_tpu import gmm_tpu
  rng = np.random.default_rng(50)
  m, k, n, e = 45, 200, 260, 4  # K, N not multiples of the 128-lane blocks
  x, w = inputs(50, m, k, n, e)
  gs = random_sizes(rng, m, e)
  rhs = jnp.swapaxes(w, 1, 2) if transpose_rhs else w
  out = gmm_tpu(x, rhs, gs, n=n, tiling=GmmTiling(bm=16, bk=128, bn=128),
                transpose_rhs=transpose_rhs, out_dtype=jnp.float32, interpret=True)
  assert rel_err(out, ref.gmm(x, w, gs)) < 1e-5
  assert bool(jnp.all(out[int(gs.sum()):] == 0))


def test_tpu_route_forward_and_gradients(monkeypatch):
  """The public gmm as it runs on a TPU (block-spec kernels), in TPU interpret mode."""
  import functools
  import importlib
  gmm_mod = importlib.import_module("pallas_kernels.gmm")  # the module (pk.gmm is the function)
  from pallas_kernels import gmm_tpu
  monkeypatch.setattr(gmm_mod, "_use_tpu", lambda interpret: True)
  monkeypatch.setattr(gmm_tpu, "gmm_tpu", functools.partial(gmm_tpu.gmm_tpu, interpret=True))
  monkeypatch.setattr(gmm_tpu, "tgmm_tpu", functools.partial(gmm_tpu.tgmm_tpu, interpret=True))
  rng = np.random.default_rng(60)
  m, k, n, e = 70, 130, 140, 6
  x, w = inputs(60, m, k, n, e)
  gs = random_sizes(rng, m, e)
  tiling = GmmTiling(bm=16, bk=128, bn=128)
  dy = jax.random.normal(jax.random.key(61), (m, n))

  def loss(f):
    return lambda x, w: jnp.sum(f(x, w) * dy)

  out = pk.gmm(x, w, gs, tiling=tiling)
  assert rel_err(out, ref.gmm(x, w, gs)) < 1e-5
  gx, gw = jax.grad(loss(lambda x, w: pk.gmm(x, w, gs, tiling=tiling)), (0, 1))(x, w)
  rx, rw = jax.grad(loss(lambda x, w: ref.gmm(x, w, gs)), (0, 1))(x, w)
  assert rel_err(gx, rx) < 1e-5 and rel_err(gw, rw) < 1e-5
  assert bool(jnp.all(gw[np.asarray(gs) == 0] == 0))
  a = jnp.swapaxes(x, 0, 1)
  assert rel_err(pk.tgmm(a, dy, gs), ref.tgmm(a, dy, gs)) < 1e-5  # lhs [K, M] layout


def test_group_sizes_summing_past_m_are_clipped():
  m, k, n, e = 30, 16, 16, 3
  x, w = inputs(70, m, k, n, e)
  gs = jnp.asarray([12, 10, 25], jnp.int32)  # sum 47 > 30: the last group gets 8 rows
  clipped = jnp.asarray([12, 10, 8], jnp.int32)
  out = pk.gmm(x, w, gs, tiling=SMALL)
  assert rel_err(out, ref.gmm(x, w, clipped)) < 1e-5


@pytest.mark.slow
def test_bench_script_smoke(tmp_path):
  """experiments/bench_gmm.py --smoke runs (tiny sizes, interpret mode) and writes JSON."""
  import json
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  subprocess.run([sys.executable, os.path.join(root, "experiments", "bench_gmm.py"), "--smoke",
                  "--cases", "check,c", "--no-bwd", "--out", str(tmp_path)],
                 check=True, capture_output=True, timeout=600)
  res = json.loads((tmp_path / "bench_gmm.json").read_text())
  assert all(c["ok"] for c in res["checks"]) and res["rows"]
