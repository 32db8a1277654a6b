"""The model's KV caches: bf16 and quantized caches against full-sequence forward passes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import load_config
from moejax.kv_eval import (KVSetting, cache_bytes, outlier_indices, quantized_cache_factory,
                            teacher_forced_caches)
from moejax.model.kv_cache import DenseKVCache, OutlierStats
from moejax.state import init_state

SMALL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
         "model.head_dim=32", "model.ffn_hidden=48", "moe.expert_hidden=24", "moe.num_experts=4",
         "model.max_seq_len=128", "kv_cache.group_size=16", "kv_cache.residual_window=16",
         "kv_cache.sink_tokens=2"]


def _model(*extra):
  cfg = load_config(None, SMALL + list(extra))
  graphdef, st = init_state(cfg)
  return cfg, graphdef, st


def _stream(cfg, graphdef, st, tokens, caches):
  """Token-by-token decode through `caches`; returns logits [B, T, V]."""
  @jax.jit
  def step(tok, pos, caches):
    model = nnx.merge(graphdef, st.params, st.buffers)
    logits, _, caches = model(tok, pos, caches)
    return logits, caches
  out = []
  for t in range(tokens.shape[1]):
    pos = jnp.full((tokens.shape[0], 1), t, jnp.int32)
    logits, caches = step(tokens[:, t:t + 1], pos, caches)
    out.append(logits)
  return jnp.concatenate(out, axis=1), caches


def _ranks(cfg, seed=0):
  rng = np.random.default_rng(seed)
  m = cfg.model
  shape = (m.num_layers, m.num_kv_heads, m.head_dim)
  return {"k_rank_LKD": np.argsort(rng.random(shape), -1).astype(np.int32),
          "v_rank_LKD": np.argsort(rng.random(shape), -1).astype(np.int32)}


def test_bf16_cache_reproduces_full_forward_step_by_step():
  cfg, graphdef, st = _model()
  tokens = jax.random.randint(jax.random.key(0), (2, 20), 0, 256)
  full, _, _ = nnx.merge(graphdef, st.params, st.buffers)(tokens)
  caches = [DenseKVCache.create(2, 32, 2, 32, jnp.float32) for _ in range(2)]
  streamed, _ = _stream(cfg, graphdef, st, tokens, caches)
  np.testing.assert_allclose(streamed, full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits, fraction", [(2, 0.15), pytest.param(4, 0.1, marks=pytest.mark.slow)])
def test_streaming_quantized_decode_equals_teacher_forced_path(bits, fraction):
  """Keys/values of earlier tokens from the real packed cache (appends, group flushes,
  Pallas decode attention) give the same logits as the fast teacher-forced path."""
  cfg, graphdef, st = _model(f"kv_cache.bits={bits}", f"kv_cache.outlier_fraction={fraction}")
  ranks = _ranks(cfg)
  T = 54  # sinks 2 + two flushed groups of 16 + a window of 20
  tokens = jax.random.randint(jax.random.key(1), (1, T), 0, 256)
  setting = KVSetting(bits, fraction)
  model = nnx.merge(graphdef, st.params, st.buffers)
  tf_logits, _, _ = model(tokens, None, teacher_forced_caches(cfg, setting, ranks, batch=1))
  caches = quantized_cache_factory(setting, ranks)(cfg, 1, T)
  streamed, caches = _stream(cfg, graphdef, st, tokens, caches)
  # The kernel multiplies bf16 operands where the teacher-forced path uses float32, so the
  # two agree to bf16 rounding, not bit for bit. To show the comparison can fail, a path
  # with the wrong cache semantics (no full-precision window) must land much further away.
  err = float(jnp.abs(streamed - tf_logits).mean())
  wrong_cfg = load_config(None, SMALL + [f"kv_cache.bits={bits}", "kv_cache.residual_window=0",
                                         f"kv_cache.outlier_fraction={fraction}"])
  wrong, _, _ = model(tokens, None, teacher_forced_caches(wrong_cfg, setting, ranks, batch=1))
  wrong_err = float(jnp.abs(streamed - wrong).mean())
  full, _, _ = model(tokens)
  assert float(jnp.abs(streamed - tf_logits).max()) < 5e-3
  assert err < 0.3 * wrong_err, (err, wrong_err)
  assert err < 0.3 * float(jnp.abs(full - tf_logits).mean())
  # Bytes reported are the bytes of the arrays held.
  for c in caches:
    assert c.nbytes == sum(a.nbytes for a in c.kv.arrays().values())


def test_8bit_cache_is_close_to_bf16():
  cfg, graphdef, st = _model("kv_cache.bits=8", "kv_cache.outlier_fraction=0", 
                             "kv_cache.meta_dtype=bfloat16")
  tokens = jax.random.randint(jax.random.key(2), (2, 64), 0, 256)
  model = nnx.merge(graphdef, st.params, st.buffers)
  ref, _, _ = model(tokens, None, teacher_forced_caches(cfg, KVSetting(16, 0.0), None, 2))
  q8, _, _ = model(tokens, None, teacher_forced_caches(cfg, KVSetting(8, 0.0), _ranks(cfg), 2))
  p_ref, p_q8 = jax.nn.softmax(ref), jax.nn.softmax(q8)
  assert float(jnp.abs(p_ref - p_q8).max()) < 2e-3


def test_calibration_finds_planted_outlier_channels():
  cfg, graphdef, st = _model()
  # Scale two key channels of layer 0, head 1 through the key projection's output columns.
  planted = [5, 17]
  wk = st.params["blocks"][0]["attn"]["wk_DKd"]
  cols = [32 + c for c in planted]
  wk[...] = wk[...].at[:, cols].multiply(50.0)
  model = nnx.merge(graphdef, st.params, st.buffers)
  caches = [OutlierStats.create(2, 32) for _ in range(2)]
  tokens = jax.random.randint(jax.random.key(3), (4, 32), 0, 256)
  _, _, caches = model(tokens, None, caches)
  rank = np.argsort(-np.asarray(caches[0].kmax_KD), axis=-1)
  # RoPE mixes channel c with c +- D/2, so the planted pair shows up among the top channels.
  top = set(np.asarray(outlier_indices(rank, 4))[1].tolist())
  assert set(planted) <= top | {c + 16 for c in planted} | {c - 16 for c in planted}
  assert len(top & ({5, 17, 21, 1})) >= 2


def test_cache_bytes_match_real_caches_and_shrink_with_bits():
  cfg, _, _ = _model()
  for bits in (16, 4, 2):
    setting = KVSetting(bits, 0.1 if bits < 16 else 0.0)
    if bits < 16:
      caches = quantized_cache_factory(setting, _ranks(cfg))(cfg, 1, 64)
      assert cache_bytes(cfg, setting, 64) == sum(c.nbytes for c in caches)
  assert cache_bytes(cfg, KVSetting(2, 0.0), 4096) < cache_bytes(cfg, KVSetting(4, 0.0), 4096) \
      < cache_bytes(cfg, KVSetting(16, 0.0), 4096) / 3
