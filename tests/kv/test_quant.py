"""pallas_kernels.kv.quant (and kv.layout): quantizer error bounds, outliers, byte accounting,
streaming appends, the channel-order and ring-slot helpers."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pallas_kernels
from pallas_kernels.kv import layout as kl
from pallas_kernels.kv import quant as kq

# jit the heavy calls (eager op-by-op dispatch is slow on a small CI machine)
_quantize = jax.jit(kq.quantize_kv, static_argnames=("config", "max_len"))
_empty = jax.jit(kq.empty_kv, static_argnums=(0, 1, 2, 3, 4))
_dequantize = jax.jit(lambda c: c.dequantize())


def _data(rng, b, h, t, d, planted=()):
  chan = np.exp(0.5 * rng.normal(size=(1, h, 1, d)))
  x = rng.normal(size=(b, h, t, d)) * chan + rng.normal(size=(1, h, 1, d))
  for c in planted:
    x[..., c] *= 40.0
  return jnp.asarray(x, jnp.float32)


def _element_scales(cache, name):
  """The quantization step of every quantized element, in channel order: [B, H, Cq, D]."""
  lay = cache.layout
  cfg = lay.config
  g = cfg.group_size
  s = getattr(cache, f"{name}_scale").astype(jnp.float32)
  axis = getattr(cfg, f"{name[0]}ey_axis" if name == "k" else "value_axis")
  if axis == "channel":
    s_lo = jnp.repeat(s, g, axis=2)[..., :lay.d_low]
  else:                                   # stored token-minor [B, H, n_groups, Cq]
    s_lo = jnp.repeat(jnp.swapaxes(s, 2, 3), g, axis=3)[..., :lay.d_low]
  lo = kq.low_channel_index(getattr(cache, f"{name}_outlier_idx"), lay.head_dim)
  b, h, cq, _ = s_lo.shape
  out = jnp.zeros((b, h, cq, lay.head_dim))
  bi, hi, ti = (jnp.arange(n).reshape(sh) for n, sh in
                ((b, (-1, 1, 1, 1)), (h, (1, -1, 1, 1)), (cq, (1, 1, -1, 1))))
  return out.at[bi, hi, ti, lo[:, :, None, :]].set(s_lo)


@pytest.mark.parametrize("bits,meta,kax,vax", [
    (2, "bfloat16", "channel", "token"),
    (3, "float8_e4m3fn", "token", "channel"),
    (4, "float16", "channel", "token"),
    (8, "float8_e4m3fn", "channel", "channel"),
])
def test_error_within_half_step_and_outliers_exact(bits, meta, kax, vax):
  rng = np.random.default_rng(bits)
  b, h, t, d = 2, 2, 200, 64
  cfg = kq.KVQuantConfig(bits=bits, group_size=16, outlier_fraction=0.1, residual_window=16,
                         sink_tokens=3, key_axis=kax, value_axis=vax, meta_dtype=meta)
  k, v = _data(rng, b, h, t, d), _data(rng, b, h, t, d)
  lengths = jnp.array([t, 141])
  c = _quantize(k, v, cfg, max_len=224, lengths=lengths)
  kd, vd, valid = _dequantize(c)
  s, cq = cfg.sink_tokens, c.layout.cq
  nq = np.asarray(c.num_quantized())
  for name, x, xd in (("k", k, kd), ("v", v, vd)):
    xb = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32))
    xd = np.asarray(xd)
    step = np.asarray(_element_scales(c, name))
    idx = np.asarray(getattr(c, f"{name}_outlier_idx"))
    for bi in range(b):
      L = int(lengths[bi])
      q = slice(s, s + nq[bi])
      err = np.abs(xd[bi, :, q] - xb[bi, :, q])
      bound = step[bi, :, :nq[bi]] / 2 * (1 + 1e-5) + 1e-6 * np.abs(xb[bi, :, q])
      is_out = np.zeros((h, d), bool)
      for hh in range(h):
        is_out[hh, idx[bi, hh]] = True
      low = ~is_out[:, None, :]
      assert (err <= bound)[np.broadcast_to(low, err.shape)].all(), name
      # outlier channels: exactly the 16-bit value
      assert (err[np.broadcast_to(~low, err.shape)] == 0).all(), name
      # sinks and window: exactly the 16-bit value; past the length: zeros
      np.testing.assert_array_equal(xd[bi, :, :s], xb[bi, :, :s])
      np.testing.assert_array_equal(xd[bi, :, s + nq[bi]:L], xb[bi, :, s + nq[bi]:L])
      assert (xd[bi, :, L:] == 0).all()
      assert bool(valid[bi, L - 1]) and not bool(valid[bi, L:].any())
    assert nq[0] == (t - s - 16) // 16 * 16 and cq >= nq[0]


def test_planted_outlier_channels_are_selected():
  rng = np.random.default_rng(1)
  planted = (3, 17, 40)
  k = _data(rng, 2, 3, 96, 64, planted)
  idx = kq.select_outlier_channels(k, 3)
  assert idx.shape == (2, 3, 3)
  assert (np.asarray(idx) == np.array(planted)).all()
  cfg = kq.KVQuantConfig(bits=2, group_size=32, outlier_fraction=3 / 64)
  c = _quantize(k, _data(rng, 2, 3, 96, 64, (5, 6, 7)), cfg)
  assert (np.asarray(c.k_outlier_idx) == np.array(planted)).all()
  assert (np.asarray(c.v_outlier_idx) == np.array((5, 6, 7))).all()
  # given (calibration) indices are used as they are, shared by the batch
  cal = jnp.array([[1, 2, 9]] * 3)
  c2 = _quantize(k, k, cfg, k_outlier_idx=cal, v_outlier_idx=cal)
  assert (np.asarray(c2.k_outlier_idx) == np.array([1, 2, 9])).all()


def test_nbytes_is_the_sum_of_the_arrays():
  cfg = kq.KVQuantConfig(bits=3, group_size=32, outlier_fraction=0.05, residual_window=32,
                         sink_tokens=4)
  rng = np.random.default_rng(2)
  c = _quantize(_data(rng, 2, 2, 100, 64), _data(rng, 2, 2, 100, 64), cfg, max_len=400)
  leaves = jax.tree.leaves(c)
  assert len(leaves) == 13
  assert c.nbytes == sum(int(np.asarray(x).nbytes) for x in leaves)
  assert c.nbytes == sum(c.nbytes_by_part().values())
  assert c.bits_per_element == pytest.approx(8 * c.nbytes / (2 * 2 * 2 * 400 * 64))


def test_effective_bits_targets_at_4k():
  """Issue 3's figures at 4k context, D=128, G=32 (quantized region: codes, 8-bit scales
  and zeros, 16-bit outliers and their indices; the fixed full-precision window/sink
  buffer is reported separately)."""
  f = lambda **kw: kq.kv_bits_per_element(kq.KVQuantConfig(group_size=32, **kw), 128, 4096)
  seed = f(bits=2, outlier_fraction=0.15)
  two = f(bits=2, outlier_fraction=0.01)
  four = f(bits=4, outlier_fraction=0.0)
  assert seed["quantized"] <= 4.6 and two["quantized"] <= 2.8 and four["quantized"] <= 4.6
  assert (round(seed["quantized"], 3), round(two["quantized"], 3), round(four["quantized"], 3)) == (
      4.595, 2.625, 4.5)
  # everything held, with no window (R = 0: only the G-slot pending buffer): 4.72, 2.75, 4.625
  assert two["total"] <= 2.8
  assert seed["total"] == pytest.approx(seed["quantized"] + 0.125, abs=1e-3)
  # 16-bit metadata costs 0.5 bit more per element at G = 32
  assert f(bits=4, outlier_fraction=0.0, meta_dtype="bfloat16")["quantized"] == pytest.approx(5.0)


@pytest.mark.parametrize("cfg", [
    kq.KVQuantConfig(bits=2, group_size=16, outlier_fraction=0.1, residual_window=32, sink_tokens=3),
    kq.KVQuantConfig(bits=3, group_size=32, outlier_fraction=0.0, residual_window=0, sink_tokens=0,
                     key_axis="token", value_axis="channel", meta_dtype="bfloat16"),
])
def test_streaming_appends_equal_quantizing_the_prefix(cfg):
  rng = np.random.default_rng(3)
  b, h, d, n_new, max_len = 3, 2, 32, 70, 192
  prefix_len = np.array([40, 3, 0])
  total = prefix_len + n_new
  x = {n: np.asarray(_data(rng, b, h, int(total.max()), d)) for n in ("k", "v")}
  idx = {n: kq.select_outlier_channels(jnp.asarray(x[n]), cfg.num_outliers(d)) for n in x}
  pre = {n: np.where(np.arange(x[n].shape[2])[None, None, :, None] < prefix_len[:, None, None, None],
                     x[n], 0.0)[:, :, :prefix_len.max()] for n in x}
  c = _quantize(jnp.asarray(pre["k"]), jnp.asarray(pre["v"]), cfg, max_len=max_len,
                     lengths=jnp.asarray(prefix_len), k_outlier_idx=idx["k"], v_outlier_idx=idx["v"])

  @jax.jit
  def run(c, ks, vs):
    return jax.lax.scan(lambda c, kv: (c.append(*kv), None), c, (ks, vs))[0]

  gather = lambda a: np.stack([a[bi, :, prefix_len[bi]:prefix_len[bi] + n_new] for bi in range(b)])
  ks, vs = (jnp.moveaxis(jnp.asarray(gather(x[n])), 2, 0) for n in ("k", "v"))
  streamed = run(c, ks, vs)
  whole = _quantize(jnp.asarray(x["k"]), jnp.asarray(x["v"]), cfg, max_len=max_len,
                         lengths=jnp.asarray(total), k_outlier_idx=idx["k"], v_outlier_idx=idx["v"])
  for f, a in streamed.arrays().items():
    a, w = np.asarray(a), np.asarray(getattr(whole, f))
    assert a.dtype == w.dtype and a.shape == w.shape, f
    np.testing.assert_array_equal(a.view(np.uint8), w.view(np.uint8), err_msg=f)


def test_empty_cache_then_appends_and_static_shapes():
  cfg = kq.KVQuantConfig(bits=4, group_size=16, outlier_fraction=0.0, residual_window=16)
  c = _empty(cfg, 2, 2, 32, 100)
  shapes = [a.shape for a in jax.tree.leaves(c)]
  rng = np.random.default_rng(4)
  x = np.asarray(_data(rng, 2, 2, 60, 32))
  step = jax.jit(kq.append_kv)
  for t in range(60):
    c = step(c, jnp.asarray(x[:, :, t]), jnp.asarray(x[:, :, t]))
  assert [a.shape for a in jax.tree.leaves(c)] == shapes
  assert list(np.asarray(c.lengths)) == [60, 60] and int(c.num_quantized()[0]) == 32
  kd, _, _ = _dequantize(c)
  xb = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
  np.testing.assert_array_equal(np.asarray(kd)[:, :, 32:60], xb[:, :, 32:60])   # window exact
  assert np.abs(np.asarray(kd)[:, :, :32] - xb[:, :, :32]).max() < 0.5


def test_config_errors():
  with pytest.raises(ValueError, match="bits must be one of"):
    kq.KVQuantConfig(bits=5)
  with pytest.raises(ValueError, match="outlier_fraction"):
    kq.KVQuantConfig(outlier_fraction=1.0)
  with pytest.raises(ValueError, match="outlier_fraction"):
    kq.KVQuantConfig(outlier_fraction=-0.1)
  with pytest.raises(ValueError, match="multiple of group_size"):
    kq.KVQuantConfig(residual_window=20, group_size=16)
  with pytest.raises(ValueError, match="power of two"):
    kq.KVQuantConfig(group_size=48)
  with pytest.raises(ValueError, match="key_axis"):
    kq.KVQuantConfig(key_axis="head")
  with pytest.raises(ValueError, match="meta_dtype"):
    kq.KVQuantConfig(meta_dtype="int8")
  cfg = kq.KVQuantConfig(outlier_fraction=0.1)
  k = jnp.zeros((1, 2, 32, 64))
  with pytest.raises(ValueError, match="exceeds max_len"):
    kq.quantize_kv(k, k, cfg, max_len=16)
  with pytest.raises(ValueError, match="k_outlier_idx must have shape"):
    kq.quantize_kv(k, k, cfg, k_outlier_idx=jnp.zeros((2, 3), jnp.int32))
  with pytest.raises(ValueError, match="outside"):
    kq.quantize_kv(k, k, cfg, k_outlier_idx=jnp.full((2, 6), 64, jnp.int32))
  with pytest.raises(ValueError, match="repeated"):
    kq.quantize_kv(k, k, cfg, k_outlier_idx=jnp.zeros((2, 6), jnp.int32))
  c = _quantize(k, k, cfg)
  with pytest.raises(ValueError, match=r"k_new and v_new must be \[B, N, A\]"):
    c.append(jnp.zeros((1, 2, 32)), jnp.zeros((1, 2, 32)))
  assert dataclasses.replace(cfg, bits=8).bits == 8


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_channel_index_helpers_match_a_sort_and_invert_the_split(data):
  """low_channel_index / channel_positions / from_split (sort- and scatter-free) agree with
  the plain argsort definition for distinct outlier channels in any order, and from_split
  puts a split [non-outliers ascending, outliers in index order] back in channel order."""
  d = data.draw(st.integers(1, 160), label="head_dim")
  n_out = data.draw(st.integers(0, min(d - 1, 24)), label="n_out")
  rows = data.draw(st.integers(1, 3), label="rows")
  rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1), label="seed"))
  idx = np.stack([rng.permutation(d)[:n_out] for _ in range(rows)]).astype(np.int32)   # any order
  lo = np.stack([np.setdiff1d(np.arange(d), r) for r in idx]).astype(np.int32)
  x = rng.normal(size=(rows, 2, d)).astype(np.float32)
  split_lo = np.take_along_axis(x, lo[:, None, :], axis=2)
  split_out = np.take_along_axis(x, idx[:, None, :], axis=2)
  pad = np.full((rows, 2, 3), 7.0, np.float32)                # padding past d_low is ignored
  got_lo, back = _channel_helpers(jnp.asarray(idx), jnp.asarray(np.concatenate([split_lo, pad], -1)),
                                  jnp.asarray(split_out), d)
  np.testing.assert_array_equal(got_lo, lo)
  np.testing.assert_array_equal(back, x)


@functools.partial(jax.jit, static_argnums=3)
def _channel_helpers(idx, split_lo, split_out, d):
  """One compile per drawn shape (op by op, the unrolled helpers cost seconds each)."""
  pos = kq.channel_positions(idx, d)[:, None, :]
  return kq.low_channel_index(idx, d), kq.from_split(split_lo, split_out, pos, idx.shape[-1])


@pytest.mark.parametrize("sinks,window,group", [(3, 16, 16), (0, 0, 32), (4, 32, 16)])
def test_fp_slot_positions_follow_the_ring(sinks, window, group):
  """Slot s < S holds sink s; slot S + (p - S) % (R + G) holds window position p, the most
  recent one written there (appends overwrite the ring); `held` is False for slots not
  yet written."""
  cfg = kq.KVQuantConfig(bits=2, group_size=group, outlier_fraction=0.0, residual_window=window,
                         sink_tokens=sinks)
  lay = kq.KVLayout(cfg, 32, 256)
  lengths = np.array([0, 1, sinks, sinks + 1, sinks + lay.ring - 1, sinks + lay.ring + 5, 200])
  pos, held = kl.fp_slot_positions(lay, jnp.asarray(lengths))
  assert pos.shape == held.shape == (len(lengths), lay.fp_slots)
  for bi, L in enumerate(lengths):
    want = {}
    for p in range(L):                     # replay the writes: later positions overwrite
      want[p if p < sinks else sinks + (p - sinks) % lay.ring] = p
    for s in range(lay.fp_slots):
      assert bool(held[bi, s]) == (s in want), (L, s)
      if s in want:
        assert int(pos[bi, s]) == want[s], (L, s)


def test_layout_shapes_and_public_names():
  cfg = kq.KVQuantConfig(bits=3, group_size=32, outlier_fraction=0.05, residual_window=32,
                         sink_tokens=4)
  lay = kq.KVLayout(cfg, 128, 1000)
  assert (lay.cpw, lay.pack_tokens, lay.n_out, lay.d_low, lay.d_pad) == (5, 320, 6, 122, 128)
  assert lay.cq % lay.pack_tokens == 0 and lay.cq % cfg.group_size == 0 and lay.cq >= 1000 - 36
  assert (lay.ring, lay.fp_slots, lay.n_groups_tok) == (64, 68, 4)
  assert kq.PACK_STRIDE == kl.PACK_STRIDE == 64 and kq.WORD_BITS == 16
  c = jax.eval_shape(lambda: kq.empty_kv(cfg, 2, 3, 128, 1000))
  assert c.k_codes.shape == (2, 3, lay.cq // lay.cpw, lay.d_pad) and c.k_codes.dtype == jnp.uint16
  assert c.k_scale.shape == (2, 3) + lay.meta_shape("channel")
  assert c.v_scale.shape == (2, 3) + lay.meta_shape("token")
  assert c.k_fp.shape == (2, 3, lay.fp_slots, 128)
  for name in ("quantize_kv", "QuantizedKV", "KVQuantConfig", "KVLayout", "append_kv", "empty_kv",
               "kv_bits_per_element", "select_outlier_channels"):
    assert getattr(pallas_kernels, name) is getattr(kq, name), name
