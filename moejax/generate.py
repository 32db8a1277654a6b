"""Loading a trained run and sampling from it with a KV cache."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.checkpoint import Checkpointer, load_run_config
from moejax.config import Config, ConfigError, load_config, with_overrides
from moejax.data import Tokenizer
from moejax.model.kv_cache import DenseKVCache
from moejax.run_io import load_tokenizer
from moejax.state import abstract_model


@dataclasses.dataclass
class TrainedModel:
  cfg: Config
  graphdef: Any
  params: Any
  buffers: Any
  tokenizer: Tokenizer
  step: int

  def module(self):
    return nnx.merge(self.graphdef, self.params, self.buffers)


def load_trained(run_dir: str | Path, overrides: list[str] | None = None) -> TrainedModel:
  """Restores the model of a run directory's latest checkpoint (written by `moejax train`):
  params and router biases only, into an abstract target (no optimizer state, no
  initialization)."""
  run_dir = Path(run_dir)
  if not (run_dir / "checkpoints").is_dir():
    raise FileNotFoundError(f"{run_dir} is not a run directory (no checkpoints/ inside)")
  saved = load_run_config(run_dir)
  _warn_if_edited(run_dir, saved)
  cfg = with_overrides(saved, overrides or [])
  graphdef, params, buffers = abstract_model(cfg)
  params, buffers, meta = Checkpointer(run_dir / "checkpoints").restore_params(
      params, buffers, cfg)
  return TrainedModel(cfg, graphdef, params, buffers, load_tokenizer(cfg, run_dir),
                      int(meta["step"]))


def _warn_if_edited(run_dir: Path, saved: Config) -> None:
  """The checkpoint's config is the run's config; config.yaml is a copy for reading. Say so
  when the copy was edited, instead of silently ignoring the edit."""
  path = run_dir / "config.yaml"
  try:
    copy = load_config(path).to_dict() if path.is_file() else None
  except ConfigError:
    copy = None
  if copy is None:
    return
  ref = saved.to_dict()
  diff = [f"{s}.{k}" for s in ref if s not in ("train", "mesh")
          for k in ref[s] if copy[s].get(k) != ref[s][k]]
  if diff:
    print(f"note: {path} differs from the checkpoint's config in {', '.join(diff)}; the "
          f"checkpoint's is used (pass key=value overrides to change a setting)",
          file=sys.stderr)


CacheFactory = Callable[[Config, int, int], list]


def dense_caches(cfg: Config, batch: int, capacity: int) -> list:
  m = cfg.model
  return [DenseKVCache.create(batch, capacity, m.num_kv_heads, m.head_dim, jnp.bfloat16)
          for _ in range(m.num_layers)]


def _sample(logits_BV, key, temperature: float, top_k: int):
  if temperature <= 0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = logits_BV / temperature
  if top_k > 0:
    kth = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth, -jnp.inf, logits_BV)
  return jax.random.categorical(key, logits_BV).astype(jnp.int32)


def generate(tm: TrainedModel, prompt_ids_BT: np.ndarray, max_new_tokens: int, *,
             temperature: float = 0.8, top_k: int = 40, seed: int = 0,
             cache_factory: CacheFactory = dense_caches) -> tuple[np.ndarray, list]:
  """Prefill the prompt, then sample token by token. -> (ids [B, T + new], final caches)."""
  prompt = jnp.asarray(prompt_ids_BT, jnp.int32)
  B, T = prompt.shape
  if T == 0:
    raise ValueError("the prompt must hold at least one token")
  capacity = T + max_new_tokens
  if capacity > tm.cfg.model.max_seq_len:
    raise ValueError(f"prompt ({T}) + new tokens ({max_new_tokens}) exceed model.max_seq_len="
                     f"{tm.cfg.model.max_seq_len}")
  caches = cache_factory(tm.cfg, B, capacity)
  graphdef = tm.graphdef

  @jax.jit
  def step(params, buffers, tokens_BT, positions_BT, caches, key):
    model = nnx.merge(graphdef, params, buffers)
    logits, _, caches = model(tokens_BT, positions_BT, caches)
    return _sample(logits[:, -1], key, temperature, top_k), caches

  key = jax.random.key(seed)
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  key, sub = jax.random.split(key)
  token, caches = step(tm.params, tm.buffers, prompt, positions, caches, sub)
  out = [prompt, token[:, None]]
  for i in range(max_new_tokens - 1):
    key, sub = jax.random.split(key)
    pos = jnp.full((B, 1), T + i, jnp.int32)
    token, caches = step(tm.params, tm.buffers, token[:, None], pos, caches, sub)
    out.append(token[:, None])
  return np.asarray(jnp.concatenate(out, axis=1)), caches


def cache_nbytes(caches: list) -> int:
  return sum(c.nbytes for c in caches)
