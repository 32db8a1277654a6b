"""The compiled quantized gmm on a CUDA GPU (marked ``gpu``; ``make test-gpu`` runs them).

The CPU suite interprets the kernel, where int8 / int4 codes become floats by plain jnp
casts; compiled with bf16 inputs, the kernel turns codes into bf16 by inline PTX (bit
tricks, no int-to-float conversions). With unit scales the weights are the codes
themselves, so the kernel must match a float32 matmul of the codes to float32
accumulation error: this checks every byte value of the PTX.

    MOEJAX_GPU_TESTS=1 python3 -m pytest -q -m gpu tests/gmm/test_gmm_gpu.py
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import _implementation
from pallas_kernels.gmm import reference

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_gpu():
  if _implementation.platform() != "gpu":
    pytest.skip("needs a CUDA GPU")


def codes_and_unit_scales(rng, bits, e, i, o):
  if bits == 8:
    codes = rng.integers(-128, 128, (e, i, o)).astype(np.int8)  # -128 too: every byte
  else:
    codes = rng.integers(0, 256, (e, i // 2, o)).astype(np.uint8)
  q = pk.QuantizedExpertWeights(jnp.asarray(codes), jnp.ones((e, 1, o), jnp.float32),
                                bits, None)
  return q, reference.dequantize_expert_weights(q.codes, q.scales, q.bits, q.group_size)


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("m", (2, 5, 32, 300))
def test_fast_dequantization_is_exact(bits, m):
  rng = np.random.default_rng(bits * 1000 + m)
  e, i, o = 8, 512, 384
  q, w_EIO = codes_and_unit_scales(rng, bits, e, i, o)
  sizes = rng.multinomial(m, np.ones(e) / e).astype(np.int32)
  x = jnp.asarray(rng.normal(size=(m, i)), jnp.bfloat16)
  got = pk.gmm(x, q, jnp.asarray(sizes), preferred_element_type=jnp.float32)
  want = reference.gmm(x.astype(jnp.float32), w_EIO, jnp.asarray(sizes), jnp.float32)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("bits,group", ((8, None), (8, 128), (4, None), (4, 128)))
def test_scaled_weights_match_dequantize_then_matmul(bits, group):
  rng = np.random.default_rng(7)
  e, i, o, m = 8, 1024, 640, 4
  w = jnp.asarray(rng.normal(size=(e, i, o)) * 0.02, jnp.float32)
  q = pk.quantize_expert_weights(w, bits=bits, group_size=group)
  sizes = jnp.asarray([1, 0, 2, 0, 0, 1, 0, 0], jnp.int32)
  x = jnp.asarray(rng.normal(size=(m, i)), jnp.bfloat16)
  got = pk.gmm(x, q, sizes, preferred_element_type=jnp.float32)
  want = reference.gmm(x.astype(jnp.float32), pk.dequantize_expert_weights(q), sizes,
                       jnp.float32)
  err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
  assert err < 1e-5, err
