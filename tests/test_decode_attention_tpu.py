"""The TPU-shaped decode kernel (decode_attention_tpu) in Pallas' TPU interpret mode, against
the dequantize-then-attend reference, and the route decode_attention takes on a TPU."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_attention_tpu as dt
from pallas_kernels import kv_quant as kq
from pallas_kernels import reference
from pallas_kernels.decode_attention import choose_backend, decode_attention


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _cache(seed, bits, group, ratio, t=700, max_len=768, lengths=(700, 333, 5), **kw):
  rng = np.random.default_rng(seed)
  b, h, d = len(lengths), 2, 64
  k = rng.normal(size=(b, h, t, d)) * np.exp(0.5 * rng.normal(size=(1, h, 1, d)))
  v = rng.normal(size=(b, h, t, d))
  q = jnp.asarray(rng.normal(size=(b, h * ratio, d)), jnp.bfloat16)
  cfg = kq.KVQuantConfig(bits=bits, group_size=group, **kw)
  cache = kq.quantize_kv(jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), cfg,
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
def test_tpu_kernel_matches_reference(bits, group, ratio, kw):
  # ragged: several tiles, mid-tile, only the window and sinks
  q, cache = _cache(bits * 10 + group, bits, group, ratio, **kw)
  out = decode_attention(q, cache, backend="tpu", interpret=True)
  ref = reference.quantized_decode_attention(q, cache)
  assert out.shape == q.shape and out.dtype == q.dtype
  for bi in range(q.shape[0]):
    assert _rel(out[bi], ref[bi]) < 1e-2, bi


def test_tpu_kernel_without_quantized_region():
  q, cache = _cache(3, 2, 32, 4, t=40, max_len=64, lengths=(40, 7), residual_window=32)
  assert cache.layout.cq == 0 or int(cache.num_quantized().max()) == 0
  out = decode_attention(q, cache, backend="tpu", interpret=True)
  assert _rel(out, reference.quantized_decode_attention(q, cache)) < 1e-2


def test_auto_takes_the_tpu_kernel_on_a_tpu(monkeypatch):
  platform = importlib.import_module("pallas_kernels._platform")
  monkeypatch.setattr(platform, "backend", lambda: "tpu")
  calls = []
  real = dt.decode_attention_tpu

  def spy(q, kv, *, sm_scale, interpret=False):
    calls.append(interpret)
    return real(q, kv, sm_scale=sm_scale, interpret=True)      # TPU interpret mode on this CPU
  monkeypatch.setattr(dt, "decode_attention_tpu", spy)
  q, cache = _cache(4, 2, 32, 4, t=300, max_len=320, lengths=(300, 100))
  assert choose_backend("auto", cache, 4, interpret=False) == "tpu"
  out = decode_attention(q, cache)                               # interpret=None: compiled route
  assert calls == [False]
  assert _rel(out, reference.quantized_decode_attention(q, cache)) < 1e-2


def test_tpu_rejects_groups_that_straddle_tiles():
  cfg = kq.KVQuantConfig(bits=3, group_size=128, outlier_fraction=0.0)    # 320-token tiles
  kv = kq.empty_kv(cfg, 1, 1, 64, 1280)
  assert not dt.supports(kv.layout)
  with pytest.raises(ValueError, match="TPU decode kernel needs group_size"):
    decode_attention(jnp.zeros((1, 2, 64), jnp.bfloat16), kv, backend="tpu", interpret=True)


def test_bf16_decode_on_a_tpu_is_the_xla_path(monkeypatch):
  from pallas_kernels.decode_attention import decode_attention_bf16
  platform = importlib.import_module("pallas_kernels._platform")
  monkeypatch.setattr(platform, "backend", lambda: "tpu")
  rng = np.random.default_rng(7)
  q = jnp.asarray(rng.normal(size=(2, 8, 64)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.normal(size=(2, 2, 50, 64)), jnp.bfloat16) for _ in range(2))
  lengths = jnp.array([50, 13])
  out = decode_attention_bf16(q, k, v, lengths)          # compiled route: no Triton on a TPU
  ref = reference.decode_attention_bf16(q, k, v, lengths)
  assert out.dtype == q.dtype and _rel(out, ref) < 1e-2
