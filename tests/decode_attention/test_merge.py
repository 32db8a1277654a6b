"""The Mosaic path's merge kernel (``decode_attention/merge_triton.py``, interpret mode) vs the
jnp merge (``decode_attention/merge.py``), its knobs (``MergeConfig``) and CUDA lowering."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import merge, merge_triton
from pallas_kernels.decode_attention.merge_triton import MergeConfig
from pallas_kernels.kv import quant as kq

_quantize = jax.jit(kq.quantize_kv, static_argnames=("config", "max_len"))


def _case(seed, *, b, n, g, p, ns, a, frac, sinks, window, lengths, max_len=160):
  """Queries qg [B, N, G, A] (scaled), a cache, and split partials as the Mosaic kernel
  writes them: m, l [B, N, NS, P], o [B, N, NS, D_pad, P] (P >= G heads, padded)."""
  rng = np.random.default_rng(seed)
  s = max(lengths)
  k = jnp.asarray(rng.normal(size=(b, n, s, a)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(b, n, s, a)), jnp.float32)
  cfg = kq.KVQuantConfig(bits=2, group_size=16, outlier_fraction=frac, residual_window=window,
                         sink_tokens=sinks)
  kv = _quantize(k, v, cfg, max_len=max_len, lengths=jnp.asarray(lengths))
  dp = kv.layout.d_pad
  qg = jnp.asarray(rng.normal(size=(b, n, g, a)) * 3, jnp.float32)
  m = rng.normal(size=(b, n, ns, p)) * 4
  m[:, :, ::3] = merge.NEG                       # empty splits, as the kernel writes them
  l = np.where(m > merge.NEG / 2, rng.uniform(0.5, 3, size=m.shape), 0.0)
  o = rng.normal(size=(b, n, ns, dp, p)) * (m > merge.NEG / 2)[:, :, :, None, :]
  return qg, kv, *(jnp.asarray(x, jnp.float32) for x in (m, l, o))


@jax.jit
def _reference(qg, kv, m, l, o):
  g = qg.shape[2]
  lay = kv.layout
  o_lo = jnp.swapaxes(o, 3, 4)[:, :, :, :g]
  o_out = o_lo[..., lay.d_low:lay.d_low + lay.n_out] if lay.n_out else None
  return merge.merge_partials(qg, kv, m[..., :g], l[..., :g], o_lo, o_out)


def _check(args, config=MergeConfig()):
  got = merge_triton.merge_heads_minor(*args, config=config, interpret=True)
  want = _reference(*args)
  assert got.shape == want.shape
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kw", [
    # outliers + sinks + window; lengths: 0, inside the sinks, inside the window, long
    dict(b=4, n=2, g=4, p=8, ns=5, a=64, frac=0.05, sinks=3, window=16, lengths=[0, 2, 20, 150]),
    # no outliers, no sinks, one query head per kv-head padded to P = 8, one split
    dict(b=2, n=1, g=1, p=8, ns=1, a=32, frac=0.0, sinks=0, window=0, lengths=[70, 33]),
    # 8 query heads per kv-head in P = 16, many splits, 4 outliers
    dict(b=1, n=2, g=8, p=16, ns=24, a=128, frac=0.03, sinks=0, window=32, lengths=[140]),
])
def test_matches_jnp_merge(kw):
  _check(_case(sum(kw["lengths"]) + kw["ns"], **kw))


_slow = pytest.mark.slow      # the default path is tested fast; the other forms in `make test-all`
_KW = dict(b=2, n=2, g=4, p=8, ns=7, a=64, frac=0.05, sinks=2, window=16, lengths=[150, 37])


@pytest.mark.parametrize("d_chunk,splits,unroll", [
    (0, 4, True), (16, 1, True), (None, 16, True),
    pytest.param(64, 32, False, marks=_slow), pytest.param(32, 2, False, marks=_slow)])
def test_chunking_does_not_change_the_result(d_chunk, splits, unroll):
  """Channel chunks (grid axis 3), splits per step and unrolled loops only reorganize the work
  (ns = 7: 7, 4 or 1 split steps; the window 3 steps: unrolled where <= MAX_UNROLL)."""
  _check(_case(11, **_KW), MergeConfig(d_chunk=d_chunk, splits_per_step=splits, unroll=unroll))


@pytest.mark.parametrize("step,dot", [(16, "f32"), (32, "split"),
                                      pytest.param(32, "f32", marks=_slow),
                                      pytest.param(64, "split", marks=_slow)])
def test_window_steps_and_dots(step, dot):
  """Window slots per step and the window's dot form (one IEEE float32 dot, or three 16-bit
  tensor-core dots) agree with the float32 reference; sinks 3 + ring 48 + window 16."""
  kw = dict(_KW, g=8, ns=3, sinks=3, lengths=[150, 40])
  _check(_case(7, **kw), MergeConfig(window_step=step, window_dot=dot))


def test_split_dot_is_float32_accurate():
  """The split dot keeps ~24 bits of the float32 operand: far closer than a dot of the
  operand rounded once to bf16 (which the test would catch)."""
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.normal(size=(16, 64)) * 5, jnp.float32)
  b = jnp.asarray(rng.normal(size=(16, 64)), jnp.bfloat16)
  want = np.asarray(a, np.float64) @ np.asarray(b, np.float64).T
  split = merge_triton._dot_f32(a, b, split=True, trans_b=True)
  once = jnp.dot(a.astype(jnp.bfloat16), b.T, preferred_element_type=jnp.float32)
  err = lambda x: float(np.abs(np.asarray(x, np.float64) - want).max())
  assert err(split) < 1e-4 < err(once)


def test_scales_the_raw_query_and_casts_the_output():
  """q_scale / out_dtype: the raw bf16 query in, bf16 out, as the Mosaic path calls it."""
  _, kv, m, l, o = _case(5, **_KW)
  q = jnp.asarray(np.random.default_rng(5).normal(size=(2, 8, 64)), jnp.bfloat16)
  scale = 64 ** -0.5
  qg = merge.scaled_queries(q, 2, scale)
  got = merge_triton.merge_heads_minor(q.reshape(qg.shape), kv, m, l, o, interpret=True,
                                       q_scale=scale * merge.LOG2E, out_dtype=jnp.bfloat16)
  assert got.dtype == jnp.bfloat16
  want = _reference(qg, kv, m, l, o).astype(jnp.bfloat16)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=8e-3, atol=8e-3)     # one bf16 rounding apart at most


def test_rejects_mismatched_partials():
  qg, kv, m, l, o = _case(0, b=1, n=1, g=4, p=8, ns=2, a=32, frac=0.0, sinks=0, window=0, lengths=[40])
  with pytest.raises(ValueError, match="partials do not match"):
    merge_triton.merge_heads_minor(qg, kv, m, l, o[:, :, :, :-1], interpret=True)
  with pytest.raises(ValueError, match="partials do not match"):       # fewer heads than G
    merge_triton.merge_heads_minor(qg, kv, m[..., :2], l[..., :2], o[..., :2], interpret=True)


@pytest.mark.parametrize("kw,match", [(dict(window_step=8), "window_step"),
                                      (dict(window_dot="tf32"), "window_dot"),
                                      (dict(splits_per_step=3), "power of two")])
def test_bad_configs_are_clear_errors(kw, match):
  with pytest.raises(ValueError, match=match):
    MergeConfig(**kw)


def test_lowers_for_cuda():
  """The Triton lowering (no GPU needed) accepts the kernel: one pallas_call, no XLA gathers."""
  qg, kv, m, l, o = _case(1, b=2, n=2, g=4, p=8, ns=3, a=128, frac=0.03, sinks=2, window=16,
                          lengths=[100, 7])
  text = jax.jit(lambda *a: merge_triton.merge_heads_minor(*a, interpret=False)).trace(
      qg, kv, m, l, o).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("decode_attention_merge") >= 1
  assert "stablehlo.gather" not in text and "stablehlo.scatter" not in text


@pytest.mark.parametrize("a,heads,d_chunk,target,want", [
    (128, 64, None, 128, 64),      # B = 8 x 8 kv-heads: 128 programs
    (128, 8, None, 128, 16),       # B = 1: as small as 16 channels
    (128, 512, None, 128, 128),    # many heads: one program per head
    (64, 4, None, 128, 16),
    (128, 8, None, 8, 128),        # few programs wanted: whole heads
    (128, 8, 0, 128, 128), (128, 8, 32, 128, 32), (96, 8, 64, 128, 96),   # given; 64 does not divide 96
])
def test_channel_chunk(a, heads, d_chunk, target, want):
  assert merge_triton._channel_chunk(a, d_chunk, heads, target) == want
