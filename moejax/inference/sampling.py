"""Next-token sampling on device: greedy, temperature, top-k and top-p (nucleus)."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """temperature 0: greedy (top_k and top_p unused). Otherwise the logits are divided by
  the temperature, cut to the top_k most likely tokens (0: no cut), then to the nucleus:
  the smallest set of those whose probability mass reaches top_p (1.0: no cut)."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    t, k, p = self.temperature, self.top_k, self.top_p
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
      raise ValueError(f"temperature {t!r}: must be a finite number >= 0 (0: greedy)")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
      raise ValueError(f"top_k {k!r}: must be an integer >= 0 (0: no top-k cut)")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
      raise ValueError(f"top_p {p!r}: must be in (0, 1] (1: no nucleus cut)")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def sample(logits_BV: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """One token per row of logits_BV -> int32[B]. Rows are sampled independently from
  one key. Pure jnp: traces into the decode loop."""
  if cfg.greedy:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = logits_BV.astype(jnp.float32) / cfg.temperature
  V = logits_BV.shape[-1]
  k = min(cfg.top_k or V, V)
  if k == V and cfg.top_p == 1.0:
    return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)
  # Candidates in descending order (a partial sort when top_k < V); both cuts act on ranks,
  # so tied logits never let more than k tokens through.
  top_BK, ids_BK = jax.lax.top_k(logits_BV, k)
  if cfg.top_p < 1.0:
    probs_BK = jax.nn.softmax(top_BK, axis=-1)
    # Mass of the more likely candidates: 0 for the first, so it is always kept.
    mass_before_BK = jnp.cumsum(probs_BK, axis=-1) - probs_BK
    top_BK = jnp.where(mass_before_BK < cfg.top_p, top_BK, -jnp.inf)
  choice_B = jax.random.categorical(key, top_BK, axis=-1)
  return jnp.take_along_axis(ids_BK, choice_B[:, None], axis=-1)[:, 0].astype(jnp.int32)
