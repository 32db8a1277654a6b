"""model.attention_impl: the training forward's causal attention (no cache) as einsums (xla)
or cuDNN's flash kernel (cudnn); auto picks cudnn only on a GPU in 16-bit compute."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import ConfigError, load_config
from moejax.model.attention import (causal_attention, causal_mask, gqa_attention,
                                    resolve_attention_impl)
from moejax.state import forward_loss, init_state


def _qkv(dtype, B=2, T=64, H=4, N=2, A=32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (B, T, H, A), dtype),
          jax.random.normal(ks[1], (B, T, N, A), dtype),
          jax.random.normal(ks[2], (B, T, N, A), dtype))


def test_auto_is_xla_off_gpu_or_in_float32():
  assert resolve_attention_impl("auto", jnp.float32) == "xla"
  want = "cudnn" if jax.default_backend() == "gpu" else "xla"
  assert resolve_attention_impl("auto", jnp.bfloat16) == want
  assert resolve_attention_impl("cudnn", jnp.float32) == "cudnn"
  q, k, v = _qkv(jnp.float32)
  np.testing.assert_array_equal(causal_attention(q, k, v, "auto"),
                                gqa_attention(q, k, v, causal_mask(64)))


def test_bad_attention_impl_is_refused():
  with pytest.raises(ConfigError, match="model.attention_impl"):
    load_config(None, ["model.attention_impl=flash"])


@pytest.mark.gpu
def test_cudnn_matches_xla_loss_and_gradients():
  q, k, v = _qkv(jnp.bfloat16, T=256, A=128)
  f = lambda impl: lambda q, k, v: causal_attention(q, k, v, impl).astype(jnp.float32).sum()
  out = {impl: jax.jit(jax.value_and_grad(f(impl), argnums=(0, 1, 2)))(q, k, v)
         for impl in ("xla", "cudnn")}
  np.testing.assert_allclose(out["cudnn"][0], out["xla"][0], rtol=2e-2)
  for a, b in zip(out["cudnn"][1], out["xla"][1]):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=5e-2, atol=5e-2)
  base = ["model.dtype=bfloat16", "model.head_dim=64", "moe.expert_impl=gmm"]
  toks = np.random.default_rng(0).integers(0, 256, (2, 65)).astype(np.int32)
  losses = {}
  for impl in ("xla", "cudnn"):
    cfg = load_config(None, base + [f"model.attention_impl={impl}"])
    graphdef, st = init_state(cfg)
    losses[impl] = float(forward_loss(cfg, graphdef, st.params, st.buffers, toks[:, :-1],
                                      toks[:, 1:])[0])
  assert losses["cudnn"] == pytest.approx(losses["xla"], rel=1e-2)
