"""sample(): greedy, temperature, top-k and top-p against numpy, on fixed logits."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.inference import SamplingConfig, sample


def _logits(B=16, V=64, seed=0):
  return jax.random.normal(jax.random.key(seed), (B, V)) * 3.0


def _draws(logits_V, cfg, n=40_000, seed=0):
  """n independent draws from one logits vector (one row per draw, one key)."""
  rows = jnp.broadcast_to(jnp.asarray(logits_V, jnp.float32), (n, len(logits_V)))
  return np.asarray(jax.jit(sample, static_argnums=2)(rows, jax.random.key(seed), cfg))


def _expected(logits_V, temperature, top_k=0, top_p=1.0):
  """The distribution by its definition: softmax(l / T) cut to the top_k, renormalized, cut
  to the smallest prefix of the ranking whose mass reaches top_p, renormalized."""
  p = np.exp(np.asarray(logits_V, np.float64) / temperature)
  p /= p.sum()
  order = np.argsort(-p)
  keep = order[:top_k] if top_k else order
  q = p[keep] / p[keep].sum()
  n = int(np.searchsorted(np.cumsum(q), top_p - 1e-12) + 1)
  out = np.zeros_like(p)
  out[keep[:n]] = q[:n] / q[:n].sum()
  return out


def test_greedy_is_argmax():
  logits = _logits()
  got = sample(logits, jax.random.key(0), SamplingConfig())
  np.testing.assert_array_equal(got, np.asarray(logits).argmax(-1))
  assert got.dtype == jnp.int32 and got.shape == (16,)


@pytest.mark.parametrize("cfg", [SamplingConfig(1.0, top_k=1), SamplingConfig(3.0, top_p=1e-6),
                                 SamplingConfig(0.5, top_k=10, top_p=1e-6)])
def test_cuts_down_to_one_token_are_greedy(cfg):
  logits = _logits(B=64)
  greedy = np.asarray(logits).argmax(-1)
  for seed in range(5):
    np.testing.assert_array_equal(sample(logits, jax.random.key(seed), cfg), greedy)


def test_top_k_samples_stay_in_the_top_k():
  logits = _logits(B=8)
  top5 = np.argsort(-np.asarray(logits), axis=-1)[:, :5]
  cfg = SamplingConfig(temperature=10.0, top_k=5)   # hot: every one of the 5 is likely
  draws = np.stack([np.asarray(sample(logits, jax.random.key(s), cfg)) for s in range(200)])
  for b in range(8):
    assert set(draws[:, b]) == set(top5[b])


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0),
                                                       (1.3, 4, 1.0), (1.0, 0, 0.8),
                                                       (0.9, 5, 0.7)])
def test_sample_frequencies_match_the_distribution(temperature, top_k, top_p):
  logits_V = np.array([2.0, 1.5, 1.0, 0.5, 0.3, 0.0, -1.0, -2.0])
  cfg = SamplingConfig(temperature, top_k, top_p)
  freq = np.bincount(_draws(logits_V, cfg), minlength=8) / 40_000
  want = _expected(logits_V, temperature, top_k, top_p)
  np.testing.assert_allclose(freq, want, atol=0.012)
  assert np.all(freq[want == 0] == 0)   # cut tokens are never drawn


def test_nucleus_keeps_the_set_that_reaches_p():
  # Probabilities 0.5, 0.3, 0.2 (p off the exact boundaries, which float32 rounding blurs).
  logits_V = np.log([0.5, 0.3, 0.2])
  for top_p, kept in [(0.49, {0}), (0.51, {0, 1}), (0.79, {0, 1}), (0.81, {0, 1, 2})]:
    assert set(_draws(logits_V, SamplingConfig(1.0, top_p=top_p), n=2000)) == kept, top_p


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p")])
def test_invalid_settings_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SamplingConfig(**kwargs)
