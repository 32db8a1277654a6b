"""The compiled kernels on a CUDA GPU vs the float32 references (every test here is marked
``gpu``).

The CPU suite runs the Triton kernel in interpret mode, where the dequantization is plain
jnp, and only lowers the Mosaic GPU kernel; these tests run the inline-PTX paths the GPU
compiles: relative L2 error < 1e-2 per sequence against ``reference.quantized_decode_attention``
(every bit width, both axis assignments, group sizes 16/32/64 with window and sinks, outlier
fractions 0-15 %, 1-16 query heads per kv-head; ragged lengths: full, mid-cache, inside the
sinks/window), and ``decode_attention_bf16`` against its reference.

Run them on a machine with a GPU, from the repo root:

    MOEJAX_GPU_TESTS=1 python3 -m pytest -q -m gpu tests/decode_attention/test_gpu.py

(``make test-gpu`` runs every ``gpu`` test the same way). tests/conftest.py pins
``JAX_PLATFORMS=cpu`` unless ``MOEJAX_GPU_TESTS=1`` is set (or ``JAX_PLATFORMS`` is set
explicitly, e.g. to ``cuda``); where jax's default backend is not a GPU these tests skip.
``make test`` deselects them (``-m "not slow and not gpu"``). The Mosaic GPU cases skip on a
GPU that is not a Hopper.
"""
import functools
import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _implementation, decode_attention, decode_attention_bf16
from pallas_kernels.decode_attention import mosaic_gpu, reference
from pallas_kernels.kv import quant as kq

pytestmark = pytest.mark.gpu

B, N, A, S, MAX_LEN = 3, 2, 128, 1000, 1024
LENGTHS = (S, 517, 3)                 # full, mid-cache, inside the sinks / window
BITS = (2, 3, 4, 8)
KIVI, SWAPPED = ("channel", "token"), ("token", "channel")
WINDOWS = {16: (0, 0), 32: (32, 4), 64: (64, 0)}          # group -> (residual window, sinks)

_quantize = jax.jit(kq.quantize_kv, static_argnames=("config", "max_len"))
_reference = jax.jit(reference.quantized_decode_attention)
_reference_bf16 = jax.jit(reference.decode_attention_bf16)


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@functools.lru_cache(maxsize=None)
def _cache(bits, group, axes, frac, meta="float8_e4m3fn"):
  """One quantized cache per layout (shared by the tests), B x N kv-heads, ragged lengths."""
  rng = np.random.default_rng(zlib.crc32(repr((bits, group, axes, frac, meta)).encode()))
  k = rng.normal(size=(B, N, S, A)) * np.exp(0.5 * rng.normal(size=(1, N, 1, A)))
  v = rng.normal(size=(B, N, S, A))
  window, sinks = WINDOWS[group] if group in WINDOWS else (group, 0)
  cfg = kq.KVQuantConfig(bits=bits, group_size=group, residual_window=window, sink_tokens=sinks,
                         key_axis=axes[0], value_axis=axes[1], outlier_fraction=frac, meta_dtype=meta)
  return _quantize(jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), cfg, max_len=MAX_LEN,
                   lengths=jnp.array(LENGTHS))


def _query(ratio, seed=0):
  return jnp.asarray(np.random.default_rng(seed + ratio).normal(size=(B, N * ratio, A)), jnp.bfloat16)


def _check(out, q, kv):
  ref = _reference(q, kv)
  assert out.shape == q.shape and out.dtype == q.dtype
  errs = [_rel(out[b], ref[b]) for b in range(B)]
  assert max(errs) < 1e-2, errs


# Triton: every bit width x axis assignment x outlier fraction (groups of 32, window and
# sinks, 4 query heads per kv-head); every bit width x group size 16 / 64 x axes; every bit
# width x 1 / 8 query heads per kv-head.
TRITON = sorted(set(
    [(bits, 32, axes, frac, 4) for bits, axes, frac in itertools.product(BITS, (KIVI, SWAPPED),
                                                                        (0.0, 0.02, 0.03, 0.15))]
    + [(bits, g, axes, 0.02, 4) for bits, g, axes in itertools.product(BITS, (16, 64), (KIVI, SWAPPED))]
    + [(bits, 32, KIVI, 0.03, r) for bits, r in itertools.product(BITS, (1, 8))]))


@pytest.mark.parametrize("bits,group,axes,frac,ratio", TRITON)
def test_triton_matches_reference(bits, group, axes, frac, ratio):
  kv = _cache(bits, group, axes, frac)
  q = _query(ratio)
  _check(decode_attention(q, kv, implementation="triton"), q, kv)


# Mosaic GPU (layouts it takes: KIVI axes, groups >= 32, <= 4 outlier channels, <= 16 heads):
# every bit width x groups of 32 / 64 x 0 / 2 / 3 % outliers at 4 heads; every bit width x
# 1 / 8 / 16 heads; groups of 128 (rotate-per-slot reads); 16-bit metadata.
MOSAIC = sorted(set(
    [(bits, g, frac, 4, "float8_e4m3fn")
     for bits, g, frac in itertools.product(BITS, (32, 64), (0.0, 0.02, 0.03))]
    + [(bits, 32, 0.02, r, "float8_e4m3fn") for bits, r in itertools.product(BITS, (1, 8, 16))]
    + [(2, 128, 0.02, 4, "float8_e4m3fn"), (8, 128, 0.0, 8, "float8_e4m3fn"),
       (3, 64, 0.02, 4, "bfloat16"), (4, 32, 0.03, 8, "float16")]))


@pytest.mark.parametrize("bits,group,frac,ratio,meta", MOSAIC)
def test_mosaic_gpu_matches_reference(bits, group, frac, ratio, meta):
  if not _implementation.is_hopper():
    pytest.skip("the Mosaic GPU kernel needs a Hopper GPU")
  kv = _cache(bits, group, KIVI, frac, meta)
  reason = mosaic_gpu.unsupported_reason(kv.layout, ratio)
  if reason is not None:
    pytest.skip(f"the Mosaic GPU kernel {reason}")
  q = _query(ratio)
  _check(decode_attention(q, kv, implementation="mosaic_gpu"), q, kv)


@pytest.mark.parametrize("frac,want", [(0.02, "mosaic_gpu"), (0.15, "triton")])
def test_default_route(frac, want):
  """implementation=None on this GPU: Mosaic on a Hopper where it takes the layout, else Triton."""
  kv = _cache(2, 32, KIVI, frac)
  q = _query(4)
  if want == "mosaic_gpu" and not _implementation.is_hopper():
    want = "triton"
  got = decode_attention(q, kv)
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(decode_attention(q, kv, implementation=want), np.float32))
  _check(got, q, kv)


@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_bf16_triton_matches_reference(ratio):
  rng = np.random.default_rng(ratio)
  k, v = (jnp.asarray(rng.normal(size=(B, N, S, A)), jnp.bfloat16) for _ in range(2))
  q = _query(ratio)
  lengths = jnp.array(LENGTHS)
  out = decode_attention_bf16(q, k, v, lengths, implementation="triton")
  ref = _reference_bf16(q, k, v, lengths)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("meta", ["bfloat16", "float16"])
def test_16bit_metadata_goes_to_triton_and_matches(meta):
  """The Mosaic kernel refuses 16-bit metadata (its fp16 zero-point fold loses 1-2 %), so the
  default route takes Triton for it, within the usual error."""
  kv = _cache(3, 64, KIVI, 0.02, meta)
  assert not mosaic_gpu.supports(kv.layout, 4)
  q = _query(4)
  _check(decode_attention(q, kv), q, kv)
