"""decode_attention / decode_attention_bf16 (``decode_attention/api.py``): the choice of
implementation (default order per device, explicit names, ordered lists falling back past
``Unsupported``), configs and input checks. The device is pretended by monkeypatching
``pallas_kernels._implementation`` (and the modules that imported its functions by name);
the implementations are spied on, so these tests run no kernel unless they say so."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import Unsupported, _implementation
from pallas_kernels.decode_attention import (MergeConfig, MosaicGpuConfig, TritonBf16Config, TritonConfig,
                                             api, reference, tpu)
from pallas_kernels.kv import quant as kq

_quantize = jax.jit(kq.quantize_kv, static_argnames=("config", "max_len"))


def _on(monkeypatch, device, hopper=False):
  """Pretends jax's default device is ``device`` ('cpu', 'gpu', 'tpu'), a Hopper GPU or not."""
  monkeypatch.setattr(_implementation, "platform", lambda: device)
  monkeypatch.setattr(_implementation, "is_hopper", lambda: hopper)


def _spy(monkeypatch, *names, table=None, refuse=()):
  """Replaces implementations by spies that record ``(name, interpret, config, sm_scale)`` and
  return zeros (or raise ``Unsupported`` for the names in ``refuse``)."""
  table = api.IMPLEMENTATIONS if table is None else table
  calls = []
  for name in names:
    def spy(q, *rest, sm_scale, config, interpret, name=name):
      calls.append((name, interpret, config, sm_scale))
      if name in refuse:
        raise Unsupported(f"{name} refuses (test)")
      return jnp.zeros_like(q)
    monkeypatch.setitem(table, name, spy)
  return calls


def _cache(frac=0.02, bits=2, group=32, b=2, n=2, a=128, s=300, max_len=512, **kw):
  rng = np.random.default_rng(bits + int(100 * frac))
  k, v = (jnp.asarray(rng.normal(size=(b, n, s, a)), jnp.float32) for _ in range(2))
  cfg = kq.KVQuantConfig(bits=bits, group_size=group, outlier_fraction=frac, **kw)
  return _quantize(k, v, cfg, max_len=max_len, lengths=jnp.array([s, s // 3][:b]))


def _q(kv, g=4, seed=0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.normal(size=(kv.batch, kv.num_heads * g, kv.layout.head_dim)), jnp.bfloat16)


@pytest.mark.parametrize("device,hopper,interpret,want", [
    ("cpu", False, True, ("triton", "xla")),          # interpret mode is Triton's
    ("gpu", True, False, ("mosaic_gpu", "triton")),   # Hopper: Mosaic, then every layout
    ("gpu", True, True, ("triton", "xla")),           # (Mosaic has no interpret mode)
    ("gpu", False, False, ("triton", "xla")),         # other GPUs
    ("tpu", False, False, ("tpu", "xla")),
    ("tpu", False, True, ("triton", "xla")),
])
def test_default_order_per_device(monkeypatch, device, hopper, interpret, want):
  _on(monkeypatch, device, hopper)
  assert api.default_order(interpret) == want


@pytest.mark.parametrize("device,hopper,frac,want,interpret", [
    ("cpu", False, 0.02, "triton", True),
    ("gpu", True, 0.02, "mosaic_gpu", False),
    ("gpu", True, 0.15, "triton", False),       # 19 outlier channels: the Mosaic kernel refuses
    ("gpu", False, 0.02, "triton", False),
    ("tpu", False, 0.02, "tpu", False),
])
def test_default_call_runs_the_first_implementation_that_takes_the_inputs(
    monkeypatch, device, hopper, frac, want, interpret):
  kv = _cache(frac)
  _on(monkeypatch, device, hopper)
  spied = [n for n in api.IMPLEMENTATIONS if n != "mosaic_gpu" or frac < 0.1]   # the real one refuses
  calls = _spy(monkeypatch, *spied)
  out = pallas_kernels.decode_attention(_q(kv), kv)
  assert out.shape == (2, 8, 128)
  assert [(c[0], c[1]) for c in calls] == [(want, interpret)]
  assert type(calls[0][2]) is api.CONFIGS.get(want, type(None))     # its default config
  assert calls[0][3] == pytest.approx(1 / math.sqrt(128))          # default sm_scale


def test_explicit_name_runs_that_implementation_only(monkeypatch):
  kv = _cache()
  calls = _spy(monkeypatch, *api.IMPLEMENTATIONS)
  for name in api.IMPLEMENTATIONS:
    api.decode_attention(_q(kv), kv, implementation=name, sm_scale=0.25)
  assert [(c[0], c[3]) for c in calls] == [(n, 0.25) for n in api.IMPLEMENTATIONS]
  assert all(c[1] is True for c in calls)                             # interpret=None on a CPU


def test_ordered_list_falls_back_past_unsupported(monkeypatch):
  kv = _cache()
  q = _q(kv)
  # the real Mosaic kernel has no interpret mode: the list goes on to xla (a real run)
  got = api.decode_attention(q, kv, implementation=["mosaic_gpu", "xla"], interpret=True)
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(api.decode_attention(q, kv, implementation="xla"), np.float32))
  # a config goes to the implementation it belongs to; the others get their defaults
  calls = _spy(monkeypatch, "mosaic_gpu", "triton", refuse=("mosaic_gpu",))
  config = TritonConfig(num_splits=2)
  api.decode_attention(q, kv, implementation=("mosaic_gpu", "triton"), config=config, interpret=False)
  assert [c[0] for c in calls] == ["mosaic_gpu", "triton"]
  assert calls[0][2] == MosaicGpuConfig() and calls[1][2] is config


def test_tpu_kernel_refusing_a_layout_falls_back():
  """3-bit tiles are 320 tokens: groups of 128 straddle them, the TPU kernel refuses."""
  kv = _cache(frac=0.0, bits=3, group=128, b=1, n=1, a=64, s=600, max_len=640)
  assert not tpu.supports(kv.layout)
  q = _q(kv, g=2)
  with pytest.raises(Unsupported, match="TPU decode kernel needs group_size"):
    api.decode_attention(q, kv, implementation="tpu", interpret=True)
  got = api.decode_attention(q, kv, implementation=["tpu", "xla"], interpret=True)
  ref = reference.quantized_decode_attention(q, kv)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref), rtol=2e-2, atol=2e-2)


def test_no_implementation_takes_the_inputs_lists_every_reason():
  kv = _cache()
  with pytest.raises(Unsupported) as e:
    api.decode_attention(_q(kv), kv, implementation=["mosaic_gpu", "tpu"], interpret=False)
  msg = str(e.value)
  assert "no implementation takes these inputs" in msg
  assert "mosaic_gpu: the Mosaic GPU kernel needs a Hopper GPU" in msg
  assert "tpu: the TPU kernel compiles for TPUs only" in msg
  assert isinstance(e.value, ValueError) and pallas_kernels.Unsupported is _implementation.Unsupported


@pytest.mark.parametrize("implementation,match", [
    ("cuda", "unknown implementation 'cuda'"),
    ("mosaic", "unknown implementation 'mosaic'"),      # the old backend names are gone
    ("auto", "unknown implementation 'auto'"),
    (["triton", "pallas"], "unknown implementation 'pallas'"),
    ([], "at least one"),
])
def test_unknown_implementation_is_an_error(monkeypatch, implementation, match):
  kv = _cache()
  calls = _spy(monkeypatch, *api.IMPLEMENTATIONS)
  with pytest.raises(ValueError, match=match) as e:
    api.decode_attention(_q(kv), kv, implementation=implementation)
  assert not isinstance(e.value, Unsupported) and not calls
  with pytest.raises(ValueError, match=match):
    k = jnp.zeros((2, 2, 64, 128), jnp.bfloat16)
    api.decode_attention_bf16(_q(kv), k, k, jnp.zeros((2,), jnp.int32), implementation=implementation)


@pytest.mark.parametrize("implementation,config", [
    ("triton", MosaicGpuConfig()),
    ("mosaic_gpu", TritonConfig()),
    ("tpu", TritonConfig()),             # the TPU and XLA implementations have no knobs
    ("xla", MosaicGpuConfig()),
    (None, MosaicGpuConfig()),           # CPU default: triton, xla
    (None, MergeConfig()),               # the merge kernel's knobs go inside MosaicGpuConfig
    ("triton", TritonBf16Config()),      # the bf16 kernel's
])
def test_config_of_another_implementation_is_an_error(monkeypatch, implementation, config):
  kv = _cache()
  calls = _spy(monkeypatch, *api.IMPLEMENTATIONS)
  with pytest.raises(ValueError, match=f"config {type(config).__name__} belongs to none"):
    api.decode_attention(_q(kv), kv, implementation=implementation, config=config)
  assert not calls


def test_bf16_config_and_names(monkeypatch):
  q = jnp.zeros((2, 8, 64), jnp.bfloat16)
  k = jnp.zeros((2, 2, 40, 64), jnp.bfloat16)
  lengths = jnp.array([40, 3])
  with pytest.raises(ValueError, match="config TritonConfig belongs to none"):
    api.decode_attention_bf16(q, k, k, lengths, config=TritonConfig())
  with pytest.raises(ValueError, match="unknown implementation 'tpu'"):
    api.decode_attention_bf16(q, k, k, lengths, implementation="tpu")
  calls = _spy(monkeypatch, "triton", "xla", table=api.BF16_IMPLEMENTATIONS)
  config = TritonBf16Config(block_k=32)
  api.decode_attention_bf16(q, k, k, lengths, config=config)
  api.decode_attention_bf16(q, k, k, lengths, implementation="xla", sm_scale=2.0)
  assert [(c[0], c[1]) for c in calls] == [("triton", True), ("xla", True)]
  assert calls[0][2] is config and calls[0][3] == pytest.approx(1 / 8) and calls[1][3] == 2.0


@pytest.mark.parametrize("device,want", [("cpu", "triton"), ("gpu", "triton"), ("tpu", "xla")])
def test_bf16_default_per_device(monkeypatch, device, want):
  _on(monkeypatch, device, hopper=device == "gpu")
  calls = _spy(monkeypatch, "triton", "xla", table=api.BF16_IMPLEMENTATIONS)
  k = jnp.zeros((1, 1, 16, 32), jnp.bfloat16)
  api.decode_attention_bf16(jnp.zeros((1, 2, 32), jnp.bfloat16), k, k, jnp.array([16]))
  assert [(c[0], c[1]) for c in calls] == [(want, device == "cpu")]


def test_bf16_on_a_tpu_is_the_xla_path(monkeypatch):
  """A real run of the default route on a (pretended) TPU: no Triton there."""
  _on(monkeypatch, "tpu")
  rng = np.random.default_rng(7)
  q = jnp.asarray(rng.normal(size=(2, 8, 64)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.normal(size=(2, 2, 50, 64)), jnp.bfloat16) for _ in range(2))
  lengths = jnp.array([50, 13])
  out = api.decode_attention_bf16(q, k, v, lengths)
  ref = reference.decode_attention_bf16(q, k, v, lengths)
  assert out.dtype == q.dtype
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), rtol=2e-2, atol=2e-2)


def test_input_shape_errors(monkeypatch):
  calls = _spy(monkeypatch, *api.IMPLEMENTATIONS)
  cfg = kq.KVQuantConfig(bits=2, group_size=16, outlier_fraction=0.0)
  cache = jax.eval_shape(lambda: kq.empty_kv(cfg, 2, 2, 32, 64))
  da = api.decode_attention
  with pytest.raises(ValueError, match="multiple of kv heads"):
    da(jnp.zeros((2, 3, 32)), cache)
  with pytest.raises(ValueError, match="does not match the cache"):
    da(jnp.zeros((2, 4, 16)), cache)                 # head dim
  with pytest.raises(ValueError, match="does not match the cache"):
    da(jnp.zeros((3, 4, 32)), cache)                 # batch
  with pytest.raises(ValueError, match=r"q must be \[B, H, A\]"):
    da(jnp.zeros((2, 4)), cache)
  with pytest.raises(ValueError, match="kv must be a QuantizedKV"):
    da(jnp.zeros((2, 4, 32)), (cache.k_fp, cache.v_fp))
  q, k = jnp.zeros((2, 4, 32)), jnp.zeros((2, 2, 64, 32), jnp.bfloat16)
  bf16 = api.decode_attention_bf16
  with pytest.raises(ValueError, match="lengths must be"):
    bf16(q, k, k, jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match=r"need q \[B, H, A\] and k, v \[B, N, S, A\]"):
    bf16(q, k, k[:, :, :32], jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match=r"need q \[B, H, A\]"):
    bf16(q[0], k, k, jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match="does not match k"):
    bf16(jnp.zeros((2, 4, 16)), k, k, jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match="multiple of kv heads"):
    bf16(jnp.zeros((2, 3, 32)), k, k, jnp.zeros((2,), jnp.int32))
  assert not calls


def test_public_names():
  assert pallas_kernels.decode_attention is api.decode_attention
  assert pallas_kernels.decode_attention_bf16 is api.decode_attention_bf16
  assert set(api.IMPLEMENTATIONS) == {"mosaic_gpu", "triton", "tpu", "xla"}
  assert set(api.BF16_IMPLEMENTATIONS) == {"triton", "xla"}
