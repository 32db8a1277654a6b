"""Validation loss, perplexity and bits per byte of a model on held-out text."""
from __future__ import annotations

import math

import jax

from moejax.data import TokenDataset, spread_val_batches, val_batches


def evaluate(eval_step, params, buffers, data: TokenDataset, batch_size: int, seq_len: int,
             max_batches: int | None = None) -> dict[str, float]:
  """eval_step(params, buffers, inputs, targets) -> (sum_nll_nats, count).

  max_batches=None scores the whole split in order; otherwise max_batches batches of windows
  spread evenly over it. Bits per byte counts the UTF-8 bytes of exactly the targets scored.
  The batches' sums stay on device until all are dispatched: one transfer at the end.
  """
  if max_batches is not None and max_batches < 1:
    raise ValueError(f"max_batches={max_batches}: must be >= 1 (None: the whole split)")
  sums, total_bytes = [], 0
  batches = (val_batches(data.val, batch_size, seq_len, drop_remainder=True) if max_batches is None
             else spread_val_batches(data.val, batch_size, seq_len, max_batches))
  for inputs, targets in batches:
    sums.append(eval_step(params, buffers, inputs, targets))
    total_bytes += int(data.tokenizer.byte_count(targets))
  host = jax.device_get(sums)
  total_nll = sum(float(nll) for nll, _ in host)
  total_tokens = sum(int(count) for _, count in host)
  if total_tokens == 0:
    raise ValueError(f"validation split too small for one batch of {batch_size}x{seq_len} tokens")
  loss = total_nll / total_tokens
  return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)),
          "val_bpb": total_nll / math.log(2) / max(total_bytes, 1), "val_tokens": total_tokens}
