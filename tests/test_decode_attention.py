"""pallas_kernels.decode_attention (interpret mode) vs dequantize-then-attend references."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import decode_attention, decode_attention_bf16
from pallas_kernels import kv_quant as kq
from pallas_kernels import reference


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _inputs(seed, b, h, g, t, d):
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(b, h, t, d)) * np.exp(0.5 * rng.normal(size=(1, h, 1, d)))
  v = rng.normal(size=(b, h, t, d))
  q = rng.normal(size=(b, h * g, d)) * 2.0
  return (jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32),
          jnp.asarray(q, jnp.bfloat16))


CASES = [
    # bits, gqa ratio, config kwargs
    (2, 4, dict(outlier_fraction=0.1, residual_window=16, sink_tokens=3, meta_dtype="float8_e4m3fn")),
    (3, 1, dict(outlier_fraction=0.0, key_axis="token", value_axis="channel", meta_dtype="bfloat16")),
    (4, 8, dict(outlier_fraction=0.2, residual_window=32, meta_dtype="float16")),  # 6 outliers: dot path
]


@pytest.mark.parametrize("bits,ratio,kw", CASES)
def test_quantized_decode_attention_matches_reference(bits, ratio, kw):
  b, h, d, t, max_len = 5, 2, 32, 180, 200
  k, v, q = _inputs(bits * 7 + ratio, b, h, ratio, t, d)
  cfg = kq.KVQuantConfig(bits=bits, group_size=16, **kw)
  # ragged: full, 0, inside the sinks, inside the first window, mid-way
  lengths = jnp.array([t, 0, 2, 20, 111])
  cache = kq.quantize_kv(k, v, cfg, max_len=max_len, lengths=lengths)
  out = decode_attention(q, cache, interpret=True, num_splits=3)
  ref = reference.quantized_decode_attention(q, cache)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert not np.isnan(np.asarray(out, np.float32)).any()
  assert (np.asarray(out[1], np.float32) == 0).all()           # length 0 -> zeros
  for bi in (0, 2, 3, 4):
    assert _rel(out[bi], ref[bi]) < 1e-2, bi


@pytest.mark.slow
def test_kernel_options_agree():
  b, h, g, d, t = 2, 2, 4, 32, 150
  k, v, q = _inputs(11, b, h, g, t, d)
  cfg = kq.KVQuantConfig(bits=2, group_size=16, outlier_fraction=0.1, residual_window=16,
                         sink_tokens=2)
  cache = kq.quantize_kv(k, v, cfg, max_len=160, lengths=jnp.array([150, 77]))
  ref = reference.quantized_decode_attention(q, cache)
  for opts in (dict(num_splits=1), dict(num_splits=7), dict(slots_per_step=4, num_splits=2),
               dict(step_tokens=16, slots_per_step=2, num_splits=3)):
    out = decode_attention(q, cache, interpret=True, **opts)
    assert _rel(out, ref) < 1e-2, opts


@pytest.mark.parametrize("bits,group,opts", [
    (4, 32, dict(num_splits=2)),                                  # G >= T: unit-level masks
    (2, 16, dict(step_tokens=16, slots_per_step=2, num_splits=1)),
])
def test_rows_first_order_matches_reference(bits, group, opts):
  """rows_first reorders the units inside each word tile; a sequence ending mid-tile then
  has masked units between valid ones, and splits hold whole tiles."""
  b, h, g, d, t = 3, 1, 4, 32, 600
  k, v, q = _inputs(23, b, h, g, t, d)
  cfg = kq.KVQuantConfig(bits=bits, group_size=group, outlier_fraction=0.05, residual_window=group)
  cache = kq.quantize_kv(k, v, cfg, max_len=640, lengths=jnp.array([600, 300, 37]))
  ref = reference.quantized_decode_attention(q, cache)
  out = decode_attention(q, cache, interpret=True, rows_first=True, **opts)
  for bi in range(b):
    assert _rel(out[bi], ref[bi]) < 1e-2, bi


def test_decode_after_streaming_appends():
  """The kernel reads a cache built by append (ring window wrapped, groups flushed)."""
  b, h, g, d = 2, 2, 2, 32
  k, v, q = _inputs(5, b, h, g, 120, d)
  cfg = kq.KVQuantConfig(bits=2, group_size=16, outlier_fraction=0.1, residual_window=16,
                         sink_tokens=2)
  c = kq.quantize_kv(k[:, :, :10], v[:, :, :10], cfg, max_len=128)
  step = jax.jit(kq.append_kv)
  for i in range(10, 120):
    c = step(c, k[:, :, i], v[:, :, i])
  ref = reference.quantized_decode_attention(q, c)
  for opts in (dict(), dict(slots_per_step=2), dict(step_tokens=16)):
    out = decode_attention(q, c, interpret=True, **opts)
    assert _rel(out, ref) < 1e-2, opts


@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_bf16_decode_attention_matches_reference(ratio):
  b, h, d, t = 3, 2, 32, 130
  k, v, q = _inputs(ratio, b, h, ratio, t, d)
  k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  lengths = jnp.array([t, 1, 64])
  out = decode_attention_bf16(q, k, v, lengths, interpret=True, num_splits=2, block_k=32)
  ref = reference.decode_attention_bf16(q, k, v, lengths)
  assert _rel(out, ref) < 1e-2


def test_errors():
  cfg = kq.KVQuantConfig(bits=2, group_size=16, outlier_fraction=0.0)
  cache = kq.empty_kv(cfg, 2, 2, 32, 64)
  with pytest.raises(ValueError, match="multiple of kv heads"):
    decode_attention(jnp.zeros((2, 3, 32)), cache, interpret=True)
  with pytest.raises(ValueError, match="does not match the cache"):
    decode_attention(jnp.zeros((2, 4, 16)), cache, interpret=True)
  with pytest.raises(ValueError, match=r"\[B, Hq, D\]"):
    decode_attention(jnp.zeros((2, 4)), cache, interpret=True)
  with pytest.raises(ValueError, match="step_tokens"):
    decode_attention(jnp.zeros((2, 4, 32)), cache, step_tokens=64, interpret=True)
  with pytest.raises(ValueError, match="slots_per_step"):
    decode_attention(jnp.zeros((2, 4, 32)), cache, slots_per_step=3, interpret=True)
  k = jnp.zeros((2, 2, 64, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match="lengths"):
    decode_attention_bf16(jnp.zeros((2, 4, 32)), k, k, jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match="block_k"):
    decode_attention_bf16(jnp.zeros((2, 4, 32)), k, k, jnp.zeros((2,), jnp.int32), block_k=48)


@pytest.mark.parametrize("rows_first", [False, True])
def test_triton_kernel_lowers_for_cuda(rows_first):
  """The compiled path (inline-PTX dequantization, both unit orders) lowers for CUDA on a
  CPU machine; its numerics are checked on a GPU by experiments/check_decode_gpu.py."""
  cfg = kq.KVQuantConfig(bits=2, group_size=32, outlier_fraction=0.02)
  kv = jax.eval_shape(lambda: kq.empty_kv(cfg, 2, 2, 128, 4096))
  q = jax.ShapeDtypeStruct((2, 8, 128), jnp.bfloat16)
  fn = lambda q, kv: decode_attention(q, kv, backend="triton", interpret=False, rows_first=rows_first)
  text = jax.jit(fn).trace(q, kv).lower(lowering_platforms=("cuda",)).as_text()
  assert "triton" in text.lower()


@pytest.mark.parametrize("path", ["mosaic", "triton"])
def test_no_sort_or_scatter_around_the_kernels(path):
  """The wrapper's channel bookkeeping (non-outlier index, split -> channel order) lowers to
  gathers only: on a GPU a sort or scatter is a kernel of its own that cost more than the
  attention kernel at B = 1, 32k (H200 trace, 2026-12-03: scatters 21 us, sorts 6 us, the
  Mosaic kernel 20 us). Lowered for CUDA on the CPU, no GPU needed."""
  from pallas_kernels import decode_attention_mgpu as dm
  cfg = kq.KVQuantConfig(bits=2, outlier_fraction=0.02, residual_window=32, sink_tokens=4)
  kv = jax.eval_shape(lambda: kq.empty_kv(cfg, 2, 8, 128, 4096))
  q = jax.ShapeDtypeStruct((2, 32, 128), jnp.bfloat16)
  fn = ((lambda q, kv: dm.decode_attention_mgpu(q, kv, sm_scale=0.1)) if path == "mosaic" else
        (lambda q, kv: decode_attention(q, kv, backend="triton", interpret=False)))
  text = jax.jit(fn).trace(q, kv).lower(lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.sort" not in text and "stablehlo.scatter" not in text
