"""Token arrays and deterministic, resumable batches.

Training batch i is a function of (seed, i) only: its B window offsets are
drawn from np.random.default_rng([seed, i]). Resuming at step s therefore
reproduces exactly the batches an uninterrupted run would have seen; the only
data state a checkpoint needs is the step.

Validation batches walk the split in order with non-overlapping windows, so
each validation token (except the first, and a tail shorter than one window)
is a target exactly once.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from moejax.data.corpus import Corpus
from moejax.data.tokenizers import Tokenizer

Batch = tuple[np.ndarray, np.ndarray]  # (inputs_BT, targets_BT), int32.


@dataclasses.dataclass(frozen=True)
class TokenDataset:
  """The whole train and val splits as flat token arrays.

  train: [N_train] int32; val: [N_val] int32. val_bytes: UTF-8 bytes of the
  validation text (= tokenizer.byte_count(val), since tokenizers round-trip).
  """
  train: np.ndarray
  val: np.ndarray
  tokenizer: Tokenizer
  val_bytes: int

  @classmethod
  def build(cls, corpus: Corpus, tokenizer: Tokenizer) -> "TokenDataset":
    train = tokenizer.encode(corpus.train_text)
    val = tokenizer.encode(corpus.val_text)
    return cls(train=train, val=val, tokenizer=tokenizer,
               val_bytes=len(corpus.val_text.encode("utf-8")))

  @property
  def bytes_per_token(self) -> float:
    """Mean UTF-8 bytes per validation token: bpb = loss/token / ln2 / this."""
    return self.val_bytes / max(len(self.val), 1)


def _check(tokens: np.ndarray, batch_size: int, seq_len: int) -> np.ndarray:
  tokens = np.asarray(tokens)
  if tokens.ndim != 1:
    raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
  if batch_size <= 0 or seq_len <= 0:
    raise ValueError(f"batch_size and seq_len must be positive, got "
                     f"{batch_size} and {seq_len}")
  if len(tokens) < seq_len + 1:
    raise ValueError(f"{len(tokens)} tokens are too few for one window of "
                     f"seq_len={seq_len} (+1 for the shifted targets)")
  return tokens


def train_batch(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int,
                step: int) -> Batch:
  """Batch number `step`: B random windows, a function of (seed, step) only.

  tokens: [N] int. Returns (inputs_BT, targets_BT) int32, where
  targets[b, t] == inputs[b, t + 1] within a window (next-token targets).
  """
  tokens = _check(tokens, batch_size, seq_len)
  if seed < 0 or step < 0:
    raise ValueError(f"seed and step must be >= 0, got {seed} and {step}")
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
  window = tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
  return window[:, :-1], window[:, 1:]


def train_batches(tokens: np.ndarray, batch_size: int, seq_len: int,
                  seed: int, start_step: int = 0) -> Iterator[Batch]:
  """Endless train_batch(..., step) for step = start_step, start_step + 1, ..."""
  # Checked here, not on the first next(), so bad arguments fail at the call.
  tokens = _check(tokens, batch_size, seq_len)
  if seed < 0 or start_step < 0:
    raise ValueError(f"seed and start_step must be >= 0, got {seed} and "
                     f"{start_step}")

  def batches() -> Iterator[Batch]:
    step = start_step
    while True:
      yield train_batch(tokens, batch_size, seq_len, seed, step)
      step += 1
  return batches()


def num_val_batches(num_tokens: int, batch_size: int, seq_len: int,
                    max_batches: int | None = None,
                    drop_remainder: bool = False) -> int:
  """How many batches val_batches yields for these arguments."""
  windows = max((num_tokens - 1) // seq_len, 0)
  n = windows // batch_size if drop_remainder else -(-windows // batch_size)
  return n if max_batches is None else min(n, max_batches)


def val_batches(tokens: np.ndarray, batch_size: int, seq_len: int,
                max_batches: int | None = None,
                drop_remainder: bool = False) -> Iterator[Batch]:
  """The split in order as non-overlapping windows, B windows per batch.

  Window j has inputs tokens[jT:(j+1)T] and targets tokens[jT+1:(j+1)T+1].
  The last batch holds fewer than B windows unless drop_remainder (use it when
  the batch must divide a device mesh). Yields (inputs_BT, targets_BT) int32.
  """
  tokens = _check(tokens, batch_size, seq_len)
  windows = (len(tokens) - 1) // seq_len
  n = num_val_batches(len(tokens), batch_size, seq_len, max_batches,
                      drop_remainder)
  offsets = np.arange(seq_len + 1)

  def batches() -> Iterator[Batch]:
    for i in range(n):
      starts = np.arange(i * batch_size, min((i + 1) * batch_size, windows))
      window = tokens[starts[:, None] * seq_len + offsets].astype(np.int32)
      yield window[:, :-1], window[:, 1:]
  return batches()


def spread_val_batches(tokens: np.ndarray, batch_size: int, seq_len: int,
                       num_batches: int) -> Iterator[Batch]:
  """num_batches x batch_size non-overlapping windows spread evenly over the whole split.

  A sample of the held-out text that covers every document, for evaluations that cannot
  afford the whole split (in-order windows would only see its first document). Falls back
  to every window when there are fewer than asked. Yields (inputs_BT, targets_BT) int32.
  """
  tokens = _check(tokens, batch_size, seq_len)
  windows = (len(tokens) - 1) // seq_len
  want = min(num_batches * batch_size, windows - windows % batch_size)
  chosen = np.linspace(0, windows - 1, want).round().astype(np.int64)
  offsets = np.arange(seq_len + 1)
  for i in range(want // batch_size):
    starts = chosen[i * batch_size:(i + 1) * batch_size]
    window = tokens[starts[:, None] * seq_len + offsets].astype(np.int32)
    yield window[:, :-1], window[:, 1:]
