"""The TPU implementation (``decode_attention/tpu.py``) in Pallas' TPU interpret mode vs the
dequantize-then-attend reference, the layouts it refuses, and the route the default call
takes on a (pretended) TPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import Unsupported, _implementation
from pallas_kernels.decode_attention import api, reference, tpu
from pallas_kernels.kv import quant as kq

_quantize = jax.jit(kq.quantize_kv, static_argnames=("config", "max_len"))
_reference = jax.jit(reference.quantized_decode_attention, static_argnames=("sm_scale",))


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _cache(seed, bits, group, ratio, s=700, max_len=768, lengths=(700, 333, 5), **kw):
  rng = np.random.default_rng(seed)
  b, n, a = len(lengths), 2, 64
  k = rng.normal(size=(b, n, s, a)) * np.exp(0.5 * rng.normal(size=(1, n, 1, a)))
  v = rng.normal(size=(b, n, s, a))
  q = jnp.asarray(rng.normal(size=(b, n * ratio, a)), jnp.bfloat16)
  cfg = kq.KVQuantConfig(bits=bits, group_size=group, **kw)
  cache = _quantize(jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), cfg,
                    max_len=max_len, lengths=jnp.array(lengths))
  return q, cache


@pytest.mark.parametrize("bits,group,ratio,kw", [
    # KIVI axes, fp8 metadata, outliers (rank-1 matmuls), window and sinks, GQA 4
    (2, 32, 4, dict(outlier_fraction=0.05, residual_window=32, sink_tokens=3)),
    # the other axis assignment, no outliers, MHA
    (4, 16, 1, dict(outlier_fraction=0.0, key_axis="token", value_axis="channel")),
    # 3-bit (320-token tiles), groups of a whole slot, bf16 metadata, 13 outliers, GQA 8
    (3, 64, 8, dict(outlier_fraction=0.2, meta_dtype="bfloat16")),
])
def test_matches_reference(bits, group, ratio, kw):
  # ragged: several tiles, mid-tile, only the window and sinks
  q, cache = _cache(bits * 10 + group, bits, group, ratio, **kw)
  out = api.decode_attention(q, cache, implementation="tpu", interpret=True)
  ref = _reference(q, cache)
  assert out.shape == q.shape and out.dtype == q.dtype
  for bi in range(q.shape[0]):
    assert _rel(out[bi], ref[bi]) < 1e-2, bi


def test_without_quantized_region():
  q, cache = _cache(3, 2, 32, 4, s=40, max_len=64, lengths=(40, 7), residual_window=32)
  assert cache.layout.cq == 0 or int(cache.num_quantized().max()) == 0
  out = api.decode_attention(q, cache, implementation="tpu", interpret=True)
  assert _rel(out, _reference(q, cache)) < 1e-2


def test_default_call_on_a_tpu_compiles_the_tpu_kernel(monkeypatch):
  """On a TPU (pretended), ``implementation=None, interpret=None`` takes the TPU kernel,
  compiled (interpret=False); the spy runs it in TPU interpret mode on this CPU."""
  monkeypatch.setattr(_implementation, "platform", lambda: "tpu")
  monkeypatch.setattr(api, "platform", lambda: "tpu", raising=False)
  calls = []

  def spy(q, kv, *, sm_scale, config=None, interpret=False):
    calls.append(interpret)
    return tpu.decode_attention_tpu(q, kv, sm_scale=sm_scale, interpret=True)
  monkeypatch.setitem(api.IMPLEMENTATIONS, "tpu", spy)
  q, cache = _cache(4, 2, 32, 4, s=300, max_len=320, lengths=(300, 100))
  out = api.decode_attention(q, cache)
  assert calls == [False]
  assert _rel(out, _reference(q, cache)) < 1e-2


def test_refuses_groups_that_straddle_tiles():
  cfg = kq.KVQuantConfig(bits=3, group_size=128, outlier_fraction=0.0)    # 320-token tiles
  kv = jax.eval_shape(lambda: kq.empty_kv(cfg, 1, 1, 64, 1280))
  assert not tpu.supports(kv.layout)
  assert tpu.supports(kq.KVLayout(kq.KVQuantConfig(bits=3, group_size=64), 64, 1280))
  assert tpu.supports(kq.KVLayout(kq.KVQuantConfig(bits=2, group_size=1024), 64, 4096))   # a multiple
  with pytest.raises(Unsupported, match="TPU decode kernel needs group_size"):
    api.decode_attention(jnp.zeros((1, 2, 64), jnp.bfloat16), kv, implementation="tpu", interpret=True)


def test_compiled_needs_a_tpu():
  cfg = kq.KVQuantConfig(bits=2, group_size=32, outlier_fraction=0.0)
  kv = jax.eval_shape(lambda: kq.empty_kv(cfg, 1, 1, 64, 1280))
  if jax.default_backend() == "tpu":
    pytest.skip("on a TPU it compiles")
  with pytest.raises(Unsupported, match="compiles for TPUs only"):
    api.decode_attention(jnp.zeros((1, 2, 64), jnp.bfloat16), kv, implementation="tpu", interpret=False)
