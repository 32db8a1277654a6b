"""Quantized expert weights (pallas_kernels.gmm.quant) and gmm on them, vs gmm/reference.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import _implementation
from pallas_kernels.gmm import reference
from pallas_kernels.gmm.plan import TritonConfig

SMALL = TritonConfig(bm=16, bk=16, bn=16, split_k=1, group_m=8, expert_major=False)
CONFIGS = {"triton": SMALL, "xla": None}
ref_gmm = jax.jit(reference.gmm, static_argnums=(3, 4))
# Jitted: one compile per call instead of one per eager op.
quantize = jax.jit(pk.quantize_expert_weights, static_argnames=("bits", "group_size"))
dequantize = jax.jit(pk.dequantize_expert_weights, static_argnums=(1,))


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def setup(seed, m, i, o, e):
  rng = np.random.default_rng(seed)
  kx, kw = jax.random.split(jax.random.key(seed))
  x, w = jax.random.normal(kx, (m, i)), jax.random.normal(kw, (e, i, o))
  sizes = rng.multinomial(m - 3, np.ones(e) / e)
  sizes[rng.integers(e)] = 0  # an expert with no rows; 3 rows past the groups
  return x, w, jnp.asarray(sizes, jnp.int32)


@jax.jit
def ref_weights(q):
  return reference.dequantize_expert_weights(q.codes, q.scales, q.bits, q.group_size)


@pytest.mark.parametrize("impl", ["triton", "xla"])
@pytest.mark.parametrize("bits,group_size", [(8, None), (4, None), (8, 16), (4, 16)])
def test_quantized_matches_dequantize_then_matmul(impl, bits, group_size):
  m, i, o, e = 35, 64, 40, 5
  x, w, gs = setup(30 + bits, m, i, o, e)
  q = quantize(w, bits=bits, group_size=group_size)
  assert q.shape == (e, i, o)
  assert q.codes.shape == (e, i // 2 if bits == 4 else i, o)
  out = pk.gmm(x, q, gs, implementation=impl, config=CONFIGS[impl], interpret=True)
  assert rel_err(out, ref_gmm(x, ref_weights(q), gs)) < 1e-5
  assert bool(jnp.all(out[int(gs.sum()):] == 0))


@pytest.mark.parametrize("bits", (8, 4))
def test_decode_default_tiling_with_split_padding(bits):
  """Decode shapes take the quantized default tiling (split over I); when I is too short
  for every split, the padding steps must neither read past the scales nor add NaNs."""
  m, i, o, e = 4, 64, 40, 5
  x, w, gs = setup(40 + bits, m, i, o, e)
  q = quantize(w, bits=bits, group_size=32)
  out = pk.gmm(x, q, gs, implementation="triton", interpret=True)
  assert rel_err(out, ref_gmm(x, ref_weights(q), gs)) < 1e-5


@pytest.mark.parametrize("impl", ["triton", "xla"])
def test_quantized_gradient_wrt_lhs_only(impl):
  m, i, o, e = 30, 32, 24, 4
  x, w, gs = setup(44, m, i, o, e)
  q = quantize(w, bits=4)

  def f(x, q):
    return jnp.sum(pk.gmm(x, q, gs, implementation=impl, config=CONFIGS[impl],
                          interpret=True) ** 2)

  gx, gq = jax.grad(f, (0, 1), allow_int=True)(x, q)
  rx = jax.grad(lambda x: jnp.sum(ref_gmm(x, ref_weights(q), gs) ** 2))(x)
  assert rel_err(gx, rx) < 1e-5
  assert bool(jnp.all(gq.scales == 0))  # the weights are constants


def test_tpu_takes_no_quantized_weights_and_the_list_falls_back():
  x, w, gs = setup(5, 20, 32, 16, 3)
  q = quantize(w, bits=8)
  with pytest.raises(_implementation.Unsupported, match="tpu: no in-kernel dequantization"):
    pk.gmm(x, q, gs, implementation="tpu", interpret=True)
  out = pk.gmm(x, q, gs, implementation=("tpu", "xla"), interpret=True)
  assert rel_err(out, ref_gmm(x, ref_weights(q), gs)) < 1e-5


@pytest.mark.parametrize("bits,group_size", [(8, None), (4, 8)])
def test_dequantize_matches_reference(bits, group_size):
  w = jax.random.normal(jax.random.key(bits), (3, 32, 16))
  q = quantize(w, bits=bits, group_size=group_size)
  np.testing.assert_array_equal(dequantize(q), ref_weights(q))
  assert dequantize(q, jnp.bfloat16).dtype == jnp.bfloat16


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_error_is_at_most_half_a_step(bits):
  w = jax.random.normal(jax.random.key(bits), (3, 32, 16))
  q = quantize(w, bits=bits, group_size=8)
  step = jnp.repeat(q.scales, 8, axis=1)
  assert bool(jnp.all(jnp.abs(dequantize(q) - w) <= step / 2 + 1e-6))
  assert q.nbytes == q.codes.size * q.codes.dtype.itemsize + q.scales.size * 4
  leaves, treedef = jax.tree_util.tree_flatten(q)
  assert len(leaves) == 2 and jax.tree_util.tree_unflatten(treedef, leaves).bits == bits


@pytest.mark.parametrize("call,match", [
    (lambda: pk.quantize_expert_weights(jnp.ones((2, 8, 4)), bits=3), "bits"),
    (lambda: pk.quantize_expert_weights(jnp.ones((8, 4)), bits=8), r"\[E, I, O\]"),
    (lambda: pk.quantize_expert_weights(jnp.ones((2, 7, 4)), bits=4), "even"),
    (lambda: pk.quantize_expert_weights(jnp.ones((2, 8, 4)), bits=4, group_size=3), "divide"),
])
def test_bad_quantize_input_raises(call, match):
  with pytest.raises(ValueError, match=match):
    call()
