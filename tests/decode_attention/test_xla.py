"""The XLA implementation (``decode_attention/xla.py``: dequantize, then plain jnp attention)
vs the float32 reference, quantized and bf16 caches."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import api, reference
from pallas_kernels.kv import quant as kq

_quantize = jax.jit(kq.quantize_kv, static_argnames=("config", "max_len"))
_reference = jax.jit(reference.quantized_decode_attention, static_argnames=("sm_scale",))


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("bits,ratio,kw", [
    (2, 4, dict(outlier_fraction=0.1, residual_window=16, sink_tokens=3)),
    (3, 1, dict(outlier_fraction=0.0, key_axis="token", value_axis="channel", meta_dtype="bfloat16")),
    (8, 8, dict(outlier_fraction=0.03, residual_window=32, meta_dtype="float16")),
])
def test_matches_reference(bits, ratio, kw):
  rng = np.random.default_rng(bits)
  b, n, a, s = 3, 2, 64, 200
  k = jnp.asarray(rng.normal(size=(b, n, s, a)) * np.exp(0.5 * rng.normal(size=(1, n, 1, a))), jnp.float32)
  v = jnp.asarray(rng.normal(size=(b, n, s, a)), jnp.float32)
  q = jnp.asarray(rng.normal(size=(b, n * ratio, a)), jnp.bfloat16)
  cfg = kq.KVQuantConfig(bits=bits, group_size=16, **kw)
  cache = _quantize(k, v, cfg, max_len=256, lengths=jnp.array([s, 0, 37]))
  out = api.decode_attention(q, cache, implementation="xla")
  ref = _reference(q, cache)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert (np.asarray(out[1], np.float32) == 0).all()                  # length 0 -> zeros
  for bi in (0, 2):
    assert _rel(out[bi], ref[bi]) < 1e-2, bi
  # float32 queries give float32 outputs; sm_scale is passed on
  out32 = api.decode_attention(q.astype(jnp.float32), cache, implementation="xla", sm_scale=0.3)
  assert out32.dtype == jnp.float32
  assert _rel(out32[0], _reference(q, cache, sm_scale=0.3)[0]) < 1e-2


@pytest.mark.parametrize("ratio", [1, 4])
def test_bf16_matches_reference(ratio):
  rng = np.random.default_rng(ratio)
  q = jnp.asarray(rng.normal(size=(3, 2 * ratio, 32)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.normal(size=(3, 2, 70, 32)), jnp.bfloat16) for _ in range(2))
  lengths = jnp.array([70, 1, 0])
  out = api.decode_attention_bf16(q, k, v, lengths, implementation="xla")
  ref = reference.decode_attention_bf16(q, k, v, lengths)
  assert out.dtype == q.dtype and (np.asarray(out[2], np.float32) == 0).all()
  assert _rel(out[:2], ref[:2]) < 1e-2


def test_runs_no_pallas_kernel():
  cfg = kq.KVQuantConfig(bits=2, group_size=32, outlier_fraction=0.02)
  kv = jax.eval_shape(lambda: kq.empty_kv(cfg, 1, 2, 128, 1024))
  q = jax.ShapeDtypeStruct((1, 8, 128), jnp.bfloat16)
  text = str(jax.make_jaxpr(lambda q, kv: api.decode_attention(q, kv, implementation="xla"))(q, kv))
  assert "pallas_call" not in text
