"""Generation that stays on the device: one compiled program prefills the batch and runs
every decode step in a `jax.lax.while_loop`, the per-layer KV caches in its carry.

Prompts of different lengths share one cache length (DenseKVCache keeps one length for the
batch): the batch is prefilled over the shortest prompt, then each step feeds a sequence
its own next prompt token while it is still inside its prompt, else the token it sampled.
A sequence is done after `max_new_tokens` new tokens or a stop token (kept in its output);
the loop ends when every sequence is done.

    engine = Engine.from_trained(load_trained(run_dir))
    new_ids, caches = engine.generate([ids_a, ids_b], 200, sampling=SamplingConfig(0.8, 40))
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.config import Config
from moejax.inference.load import TrainedModel, decode_layout
from moejax.inference.sampling import SamplingConfig, sample
from moejax.model.kv_cache import DenseKVCache

# (cfg, batch, capacity) -> one KV cache per layer; called inside the compiled program.
CacheFactory = Callable[[Config, int, int], list]


def dense_caches(cfg: Config, batch: int, capacity: int, dtype=jnp.bfloat16) -> list:
  m = cfg.model
  return [DenseKVCache.create(batch, capacity, m.num_kv_heads, m.head_dim, dtype)
          for _ in range(m.num_layers)]


def cache_nbytes(caches: list) -> int:
  return sum(c.nbytes for c in caches)


def end_token_ids(tokenizer) -> tuple[int, ...]:
  """The tokenizer's end-of-text id as stop tokens, if it has one (an `eos_id` >= 0);
  the byte and BPE tokenizers of moejax.data have none."""
  eos = getattr(tokenizer, "eos_id", None)
  return (int(eos),) if eos is not None and int(eos) >= 0 else ()


def pad_prompts(prompts, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads the prompts to the longest -> (int32[B, P], lengths int32[B]); a clear error
  for an empty list, an empty or nested prompt, or an id outside [0, vocab_size)."""
  if np.ndim(prompts[0] if len(prompts) else 0) != 1:
    raise ValueError("prompts: expected a non-empty list of token-id lists, one per sequence")
  rows = [np.asarray(p) for p in prompts]
  if any(r.ndim != 1 for r in rows):
    raise ValueError("prompts: each prompt must be a flat list of token ids")
  for b, row in enumerate(rows):
    if row.size == 0:
      raise ValueError(f"prompt {b} is empty: each prompt needs at least one token")
    if not np.issubdtype(row.dtype, np.integer) or row.min() < 0 or row.max() >= vocab_size:
      raise ValueError(f"prompt {b}: token ids must be integers in [0, {vocab_size})")
  lengths_B = np.array([r.size for r in rows], np.int32)
  prompt_BP = np.zeros((len(rows), lengths_B.max()), np.int32)
  for b, row in enumerate(rows):
    prompt_BP[b, :row.size] = row
  return prompt_BP, lengths_B


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Everything the compiled program is specialized on; the key of Engine's cache."""
  batch: int
  padded_len: int      # longest prompt: the prompt array's width
  prefill_len: int     # shortest prompt: tokens prefilled at once
  max_new_tokens: int
  sampling: SamplingConfig
  stop_tokens: tuple[int, ...]

  @property
  def capacity(self) -> int:
    return self.padded_len + self.max_new_tokens


class Engine:
  """Holds a model and its compiled generation programs, one per _Plan, so that calls with
  the same shapes and settings reuse them (`num_traces` counts the traces)."""

  def __init__(self, cfg: Config, graphdef: Any, params: Any, buffers: Any,
               cache_factory: CacheFactory = dense_caches):
    graphdef, params, buffers = decode_layout(graphdef, params, buffers)
    self.cfg, self.graphdef, self.params, self.buffers = cfg, graphdef, params, buffers
    self.cache_factory = cache_factory
    self.num_traces = 0
    self._compiled: dict[_Plan, Callable] = {}

  @classmethod
  def from_trained(cls, tm: TrainedModel, cache_factory: CacheFactory = dense_caches) -> "Engine":
    return cls(tm.cfg, tm.graphdef, tm.params, tm.buffers, cache_factory)

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
               sampling: SamplingConfig = SamplingConfig(), stop_tokens: Sequence[int] = (),
               seed: int = 0) -> tuple[list[list[int]], list]:
    """prompts: one list of token ids per sequence. -> (each sequence's new token ids, at
    most max_new_tokens and ending at its first stop token; the final KV caches)."""
    prompt_BP, lengths_B = self._pad(prompts)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
        or max_new_tokens < 1:
      raise ValueError(f"max_new_tokens {max_new_tokens!r}: must be an integer >= 1")
    if not isinstance(sampling, SamplingConfig):
      raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    V = self.cfg.model.vocab_size
    stops = tuple(int(t) for t in stop_tokens)
    if any(not 0 <= t < V for t in stops):
      raise ValueError(f"stop tokens {stops}: ids must be in [0, {V})")
    plan = _Plan(len(lengths_B), prompt_BP.shape[1], int(lengths_B.min()), int(max_new_tokens),
                 sampling, stops)
    limit = self.cfg.model.max_seq_len
    if plan.capacity > limit:
      raise ValueError(f"longest prompt ({plan.padded_len}) + new tokens ({max_new_tokens}) "
                       f"exceed model.max_seq_len={limit}")
    run = self._compiled.get(plan)
    if run is None:
      run = self._compiled[plan] = jax.jit(self._program(plan))
    new_BN, num_new_B, caches = run(self.params, self.buffers, jnp.asarray(prompt_BP),
                                    jnp.asarray(lengths_B), jax.random.key(seed))
    new_BN, num_new_B = np.asarray(new_BN), np.asarray(num_new_B)  # the one transfer back
    return [row[:n].tolist() for row, n in zip(new_BN, num_new_B)], caches

  def _pad(self, prompts) -> tuple[np.ndarray, np.ndarray]:
    return pad_prompts(prompts, self.cfg.model.vocab_size)

  def _program(self, plan: _Plan) -> Callable:
    cfg, graphdef, factory = self.cfg, self.graphdef, self.cache_factory
    B, P, P0, N = plan.batch, plan.padded_len, plan.prefill_len, plan.max_new_tokens
    stop_S = jnp.asarray(plan.stop_tokens or (-1,), jnp.int32)  # -1 never matches

    def run(params, buffers, prompt_BP, lengths_B, key):
      self.num_traces += 1   # Python side effect: runs once per trace, not per call
      model = nnx.merge(graphdef, params, buffers)
      slot_N = jnp.arange(N, dtype=jnp.int32)

      def advance(pos, candidate_B, new_BN, num_new_B, done_B):
        """Decides each sequence's token at position `pos`: its prompt's while inside it,
        else `candidate_B`, recorded as a new token unless the sequence is done."""
        in_prompt_B = pos < lengths_B
        prompt_tok_B = jax.lax.dynamic_index_in_dim(prompt_BP, jnp.minimum(pos, P - 1), 1,
                                                    keepdims=False)
        is_new_B = ~in_prompt_B & ~done_B
        write_BN = is_new_B[:, None] & (slot_N == (pos - lengths_B)[:, None])
        new_BN = jnp.where(write_BN, candidate_B[:, None], new_BN)
        num_new_B = num_new_B + is_new_B.astype(jnp.int32)
        stopped_B = (candidate_B[:, None] == stop_S).any(-1)
        done_B = done_B | (is_new_B & (stopped_B | (num_new_B >= N)))
        return jnp.where(in_prompt_B, prompt_tok_B, candidate_B), (new_BN, num_new_B, done_B)

      # Prefill: the first P0 positions of every prompt at once; the caches are made here, on
      # device, and never leave the program until it returns.
      positions_BT = jnp.broadcast_to(jnp.arange(P0, dtype=jnp.int32), (B, P0))
      logits_BTV, _, caches = model(prompt_BP[:, :P0], positions_BT, factory(cfg, B, plan.capacity))
      # Each step's key is a function of (seed, position predicted) alone.
      candidate_B = sample(logits_BTV[:, -1], jax.random.fold_in(key, P0), plan.sampling)
      outputs = (jnp.full((B, N), -1, jnp.int32), jnp.zeros((B,), jnp.int32),
                 jnp.zeros((B,), bool))
      feed_B, outputs = advance(jnp.int32(P0), candidate_B, *outputs)

      def not_done(carry):
        pos, _, _, (_, _, done_B) = carry
        return ~done_B.all() & (pos < plan.capacity)   # the bound is a safety net

      def decode_step(carry):
        pos, feed_B, caches, outputs = carry   # feed_B: the token at position pos
        logits_BTV, _, caches = model(feed_B[:, None], jnp.full((B, 1), pos, jnp.int32), caches)
        candidate_B = sample(logits_BTV[:, 0], jax.random.fold_in(key, pos + 1), plan.sampling)
        feed_B, outputs = advance(pos + 1, candidate_B, *outputs)
        return pos + 1, feed_B, caches, outputs

      _, _, caches, (new_BN, num_new_B, _) = jax.lax.while_loop(
          not_done, decode_step, (jnp.int32(P0), feed_B, caches, outputs))
      return new_BN, num_new_B, caches

    return run
