"""Routing traces: per layer, the hidden state entering the FFN block and, per MoE layer, the
experts its router picked, recorded by one jitted forward per batch (issue 36: predicting
the experts of layers further down, for prefetching them).

A trace is host numpy, tokens flattened batch-major (row b·T + t is token t of sequence b);
L is every layer in hidden_LTD and the MoE layers (moe_layers) in the other _L arrays:
  hidden_LTD  float32 [layers, T, D]  the residual stream after layer l's attention, i.e.
              the input of l's FFN RMSNorm (every layer, dense ones too: any layer can
              predict a later one)
  expert_LTK  int32   [MoE layers, T, K]  routing.route_tokens' expert per slot
  used_LTK    bool    [MoE layers, T, K]  slot kept (selected and not dropped by capacity):
              the experts whose weights the layer actually reads for this token
  probs_LTE   float32 [MoE layers, T, E]  the router softmax (the previous-token baseline
              ranks the experts it did not use by it)
  position_T  int32   [T]  position in its sequence (0: no previous token)

The recorder walks the model's own modules (embedding, attention, norms, routers, FFNs) in
the order Transformer.__call__ / Block.__call__ run them; tests check that its routing is
the model's (the same per-expert loads as the model's statistics).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.data import TokenDataset, spread_val_batches, train_batch
from moejax.model import routing

TRACE_SEED = 36   # train-split windows of a trace (fixed: the same windows on every call)


@dataclasses.dataclass
class RoutingTrace:
  hidden_LTD: np.ndarray
  expert_LTK: np.ndarray
  used_LTK: np.ndarray
  probs_LTE: np.ndarray
  position_T: np.ndarray
  moe_layers: tuple[int, ...]

  @property
  def num_tokens(self) -> int:
    return int(self.position_T.shape[0])

  def moe_index(self, layer: int) -> int:
    """Row of MoE layer `layer` (a model layer index) in the _L* arrays (L: MoE layers there)."""
    return self.moe_layers.index(layer)

  def used_TE(self, layer: int) -> np.ndarray:
    """bool [T, E]: expert e was used by the token at MoE layer `layer`."""
    i = self.moe_index(layer)
    E = self.probs_LTE.shape[-1]
    out = np.zeros((self.num_tokens, E), bool)
    rows = np.broadcast_to(np.arange(self.num_tokens)[:, None], self.expert_LTK[i].shape)
    out[rows[self.used_LTK[i]], self.expert_LTK[i][self.used_LTK[i]]] = True
    return out


def _make_recorder(graphdef, moe_cfg):
  @jax.jit
  def record(params, buffers, tokens_BT):
    model = nnx.merge(graphdef, params, buffers)
    B, T = tokens_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x_BTD = model.embed_VD[...][tokens_BT].astype(model.dtype)
    hidden, routes = [], []
    last = len(model.blocks) - 1
    for i, block in enumerate(model.blocks):
      a_BTD, _ = block.attn(block.attn_norm(x_BTD), positions_BT, None)
      x_BTD = x_BTD + a_BTD
      hidden.append(x_BTD.astype(jnp.float32).reshape(B * T, -1))
      h_BTD = block.ffn_norm(x_BTD)
      if block.is_moe:
        bias_E = None if block.ffn.bias_E is None else block.ffn.bias_E[...]
        r = routing.route_tokens(moe_cfg, h_BTD.reshape(B * T, -1), block.ffn.router_DE[...],
                                 bias_E)
        routes.append((r.expert_TK, r.keep_TK, r.probs_TE))
      if i < last:   # the last FFN's output feeds nothing recorded
        x_BTD = x_BTD + (block.ffn(h_BTD)[0] if block.is_moe else block.ffn(h_BTD))
    return jnp.stack(hidden), [jnp.stack(a) for a in zip(*routes)]

  return record


def record_trace(tm, windows_BT: list[np.ndarray]) -> RoutingTrace:
  """The trace of a TrainedModel (inference.load) over batches of token windows.

  All batches are dispatched before the first is fetched; host memory is the trace itself
  (~4·layers·D bytes a token), so callers cap the tokens (trace_windows)."""
  model = tm.module()
  moe_layers = tuple(model.moe_layers)
  if not moe_layers:
    raise ValueError("the model has no MoE layer: there are no experts to trace")
  record = _make_recorder(tm.graphdef, tm.cfg.moe)
  outs = [record(tm.params, tm.buffers, w) for w in windows_BT]
  hidden, expert, used, probs = [], [], [], []
  for h, (e, u, p) in jax.device_get(outs):
    hidden.append(h), expert.append(e), used.append(u), probs.append(p)
  positions = [np.tile(np.arange(w.shape[1], dtype=np.int32), w.shape[0]) for w in windows_BT]
  cat = lambda xs: np.concatenate(xs, axis=1)
  return RoutingTrace(cat(hidden), cat(expert), cat(used), cat(probs),
                      np.concatenate(positions), moe_layers)


def trace_windows(data: TokenDataset, split: str, tokens: int, batch_size: int,
                  seq_len: int) -> list[np.ndarray]:
  """Input windows of about `tokens` tokens (whole sequences of seq_len, at least one), in
  batches of at most batch_size: held-out ('val') windows spread evenly over the split (as
  spread_val_batches), or fixed random windows of the training split ('train')."""
  if tokens < 1:
    raise ValueError(f"--tokens {tokens}: must be >= 1")
  n_seq = max(1, tokens // seq_len)
  if split == "val":
    rows = [w for w, _ in spread_val_batches(data.val, 1, seq_len, n_seq)]
    inputs_NT = np.concatenate(rows)
  elif split == "train":
    inputs_NT, _ = train_batch(data.train, n_seq, seq_len, seed=TRACE_SEED, step=0)
  else:
    raise ValueError(f"unknown split {split!r}")
  return [inputs_NT[i:i + batch_size] for i in range(0, len(inputs_NT), batch_size)]
