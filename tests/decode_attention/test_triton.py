"""The Triton implementation (``decode_attention/triton.py``) in interpret mode vs the
dequantize-then-attend reference, its config, and its CUDA lowering (no GPU needed; the
compiled kernel's numerics: tests/decode_attention/test_gpu.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import Unsupported
from pallas_kernels.decode_attention import TritonBf16Config, TritonConfig, decode_attention, decode_attention_bf16
from pallas_kernels.decode_attention import reference
from pallas_kernels.decode_attention import triton, triton_bf16
from pallas_kernels.kv import quant as kq


# jitted: op by op, the quantizer and the references cost seconds per call on a small machine
_quantize = jax.jit(kq.quantize_kv, static_argnames=("config", "max_len"))
_reference = jax.jit(reference.quantized_decode_attention, static_argnames=("sm_scale",))
_reference_bf16 = jax.jit(reference.decode_attention_bf16, static_argnames=("sm_scale",))


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _inputs(seed, b, n, g, s, a):
  """k, v [B, N, S, A] float32 (keys with per-channel scales), q [B, N * G, A] bf16."""
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(b, n, s, a)) * np.exp(0.5 * rng.normal(size=(1, n, 1, a)))
  v = rng.normal(size=(b, n, s, a))
  q = rng.normal(size=(b, n * g, a)) * 2.0
  return (jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), jnp.asarray(q, jnp.bfloat16))


def _triton(q, kv, config=None):
  return decode_attention(q, kv, implementation="triton", config=config, interpret=True)


CASES = [
    # bits, query heads per kv-head, config kwargs
    (2, 4, dict(outlier_fraction=0.1, residual_window=16, sink_tokens=3, meta_dtype="float8_e4m3fn")),
    (3, 1, dict(outlier_fraction=0.0, key_axis="token", value_axis="channel", meta_dtype="bfloat16")),
    (4, 8, dict(outlier_fraction=0.2, residual_window=32, meta_dtype="float16")),  # 6 outliers: dot path
]


@pytest.mark.parametrize("bits,ratio,kw", CASES)
def test_matches_reference(bits, ratio, kw):
  b, n, a, s, max_len = 5, 2, 32, 180, 200
  k, v, q = _inputs(bits * 7 + ratio, b, n, ratio, s, a)
  cfg = kq.KVQuantConfig(bits=bits, group_size=16, **kw)
  # ragged: full, 0, inside the sinks, inside the first window, mid-way
  lengths = jnp.array([s, 0, 2, 20, 111])
  cache = _quantize(k, v, cfg, max_len=max_len, lengths=lengths)
  out = _triton(q, cache, TritonConfig(num_splits=3))
  ref = _reference(q, cache)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert not np.isnan(np.asarray(out, np.float32)).any()
  assert (np.asarray(out[1], np.float32) == 0).all()           # length 0 -> zeros
  for bi in (0, 2, 3, 4):
    assert _rel(out[bi], ref[bi]) < 1e-2, bi


@pytest.mark.parametrize("bits,group,config", [
    (4, 32, TritonConfig(num_splits=2)),                                   # G >= T: unit-level masks
    (2, 16, TritonConfig(step_tokens=16, slots_per_step=2, num_splits=1)),
])
def test_sequences_ending_mid_tile(bits, group, config):
  """Splits hold whole units; a sequence ends mid-tile, mid-step (lengths 300, 37)."""
  b, n, g, a, s = 3, 1, 4, 32, 600
  k, v, q = _inputs(23, b, n, g, s, a)
  cfg = kq.KVQuantConfig(bits=bits, group_size=group, outlier_fraction=0.05, residual_window=group)
  cache = _quantize(k, v, cfg, max_len=640, lengths=jnp.array([600, 300, 37]))
  ref = _reference(q, cache)
  out = _triton(q, cache, config)
  for bi in range(b):
    assert _rel(out[bi], ref[bi]) < 1e-2, bi


@pytest.mark.slow
def test_configs_agree():
  b, n, g, a, s = 2, 2, 4, 32, 150
  k, v, q = _inputs(11, b, n, g, s, a)
  cfg = kq.KVQuantConfig(bits=2, group_size=16, outlier_fraction=0.1, residual_window=16,
                         sink_tokens=2)
  cache = _quantize(k, v, cfg, max_len=160, lengths=jnp.array([150, 77]))
  ref = _reference(q, cache)
  for config in (TritonConfig(num_splits=1), TritonConfig(num_splits=7),
                 TritonConfig(slots_per_step=4, num_splits=2),
                 TritonConfig(step_tokens=16, slots_per_step=2, num_splits=3)):
    assert _rel(_triton(q, cache, config), ref) < 1e-2, config


def test_decode_after_streaming_appends():
  """The kernel reads a cache built by append (ring window wrapped, groups flushed)."""
  b, n, g, a = 2, 2, 2, 32
  k, v, q = _inputs(5, b, n, g, 120, a)
  cfg = kq.KVQuantConfig(bits=2, group_size=16, outlier_fraction=0.1, residual_window=16,
                         sink_tokens=2)
  c = _quantize(k[:, :, :10], v[:, :, :10], cfg, max_len=128)
  appends = jax.jit(lambda c, ks, vs: jax.lax.scan(lambda c, kv: (c.append(*kv), None), c, (ks, vs))[0])
  c = appends(c, jnp.moveaxis(k[:, :, 10:], 2, 0), jnp.moveaxis(v[:, :, 10:], 2, 0))
  assert list(np.asarray(c.lengths)) == [120, 120]
  ref = _reference(q, c)
  for config in (None, TritonConfig(step_tokens=16, slots_per_step=2)):
    assert _rel(_triton(q, c, config), ref) < 1e-2, config


@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_bf16_matches_reference(ratio):
  b, n, a, s = 3, 2, 32, 130
  k, v, q = _inputs(ratio, b, n, ratio, s, a)
  k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  lengths = jnp.array([s, 1, 64])
  out = decode_attention_bf16(q, k, v, lengths, implementation="triton", interpret=True,
                              config=TritonBf16Config(num_splits=2, block_k=32))
  ref = _reference_bf16(q, k, v, lengths)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert _rel(out, ref) < 1e-2


def test_sm_scale_is_applied():
  k, v, q = _inputs(3, 2, 1, 4, 64, 32)
  cfg = kq.KVQuantConfig(bits=4, group_size=16, outlier_fraction=0.0, residual_window=16)
  cache = _quantize(k, v, cfg, max_len=64)
  out = decode_attention(q, cache, implementation="triton", interpret=True, sm_scale=0.5)
  ref = _reference(q, cache, sm_scale=0.5)
  assert _rel(out, ref) < 1e-2
  assert _rel(out, _reference(q, cache)) > 5e-2


@pytest.mark.parametrize("make,match", [
    (lambda: TritonConfig(step_tokens=64), "step_tokens"),
    (lambda: TritonConfig(slots_per_step=3), "slots_per_step"),
    (lambda: TritonConfig(num_splits=0), "num_splits"),
    (lambda: TritonBf16Config(block_k=48), "block_k"),
    (lambda: TritonBf16Config(num_splits=True), "num_splits"),
])
def test_bad_configs_are_clear_errors(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_compiled_needs_a_gpu():
  cfg = kq.KVQuantConfig(bits=2, group_size=16, outlier_fraction=0.0)
  if jax.default_backend() == "gpu":
    pytest.skip("on a GPU the Triton kernel compiles")
  cache = jax.eval_shape(lambda: kq.empty_kv(cfg, 1, 2, 32, 64))   # refused before any work
  q = jnp.zeros((1, 4, 32), jnp.bfloat16)
  with pytest.raises(Unsupported, match="compiles for GPUs only"):
    decode_attention(q, cache, implementation="triton", interpret=False)
  k = jnp.zeros((1, 2, 64, 32), jnp.bfloat16)
  with pytest.raises(Unsupported, match="compiles for GPUs only"):
    decode_attention_bf16(q, k, k, jnp.zeros((1,), jnp.int32), implementation="triton", interpret=False)


def _cuda_text(fn, *args):
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("bits,frac,config", [(2, 0.02, TritonConfig()), (3, 0.15, TritonConfig(step_tokens=16))])
def test_lowers_for_cuda(bits, frac, config):
  """The compiled path (inline-PTX dequantization; outliers as rank-1 updates or a dot)
  lowers for CUDA on a CPU machine, and the wrapper's channel bookkeeping (non-outlier
  index, split -> channel order) lowers to gathers only: on a GPU a sort or scatter is a
  kernel of its own that cost more than the attention kernel at B = 1, 32k (H200 trace,
  2026-12-03: scatters 21 us, sorts 6 us, the Mosaic kernel 20 us)."""
  cfg = kq.KVQuantConfig(bits=bits, group_size=32, outlier_fraction=frac, residual_window=32,
                         sink_tokens=4)
  kv = jax.eval_shape(lambda: kq.empty_kv(cfg, 2, 2, 128, 4096))
  q = jax.ShapeDtypeStruct((2, 8, 128), jnp.bfloat16)
  text = _cuda_text(lambda q, kv: triton._decode_quant(q, kv, sm_scale=128 ** -0.5, config=config,
                                                       interpret=False), q, kv)
  assert "decode_attention_quantized" in text and "shf.r.wrap.b32" in text
  assert "stablehlo.sort" not in text and "stablehlo.scatter" not in text


def test_bf16_lowers_for_cuda():
  q = jax.ShapeDtypeStruct((2, 8, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 2, 4096, 128), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  text = _cuda_text(lambda q, k, v, L: triton_bf16._decode_bf16(q, k, v, L, sm_scale=0.1, config=TritonBf16Config(),
                                                           interpret=False), q, k, k, lengths)
  assert "decode_attention_bf16" in text
