"""Expert prefetch predictors and their recall (issue 36).

At layer L a decoder could start fetching the experts that layer L + d (d >= 1) will need.
A predictor ranks, from what is known at layer L, the E experts of MoE layer L + d; the
decoder would fetch the top m. Every predictor has one method,
`scores(trace, src, dst) -> scores_TE` (float32, higher = fetch first; ties go to the lower
expert index), for src = L and dst = L + d over a RoutingTrace (routing_trace.py):

  gate       lookahead gate (Fate-style): dst's router applied to src's FFN input (the
             residual after src's attention) normalized by dst's FFN RMSNorm, i.e. exactly
             what dst would compute if the layers between added nothing. dst's norm, not
             src's: the router was trained on inputs carrying dst's norm scale, and the RMS
             normalization removes the residual's growth between the layers. Ranked by the
             router's own selection scores (probs, or logits for topk_softmax, plus the
             selection bias when the model has one); with d = 0 it is the routing itself.
  learned    per (src, dst) an affine map of src's RMS-normalized FFN input (no scale) to E
             scores, fit by ridge regression (closed form, centered, bias unpenalized) to
             the multi-hot of dst's used experts on a training-split trace.
  learned, next token  per (src, dst) with dst <= src, the same kind of map from the current
             token's src state to dst's experts of the *next* token (fit on the trace shifted
             by one position). Offload eviction needs it: the experts of the layers a token
             has passed are next wanted by the next token (offload_cache.py).
  previous   dst's experts of the previous token of the same sequence (known by the time
             the current token reaches L), then its other experts by that token's router
             probabilities; the first token of a sequence falls back to frequency.
  frequency  dst's expert frequency on the training-split trace (the same for every token).

Recall (`recall_counts`): for target layer dst, token t, U_t the experts t actually uses at
dst (kept slots: selected by the router and not dropped by capacity) and P_t the top-m of
scores_TE[t], recall = sum_t |U_t ∩ P_t| / sum_t |U_t|. "Overall" sums numerator and
denominator over the target layers (weighting each token by its experts: with a fixed k
that is a token-weighted mean of the per-layer recalls). m >= E fetches everything: 1.0.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from moejax.config import Config, is_moe_layer
from moejax.inference.routing_trace import RoutingTrace

PREDICTOR_FILE = "predictor.npz"
PREDICTOR_META = "predictor.json"   # a readable copy of the metadata inside the .npz
DEFAULT_LOOKAHEAD = (1, 2, 3)
DEFAULT_RIDGE = 1e-3
# Settings that do not change which experts a token picks: left out of the model digest.
_ROUTING_NEUTRAL = ("expert_impl", "aux_loss_coef", "z_loss_coef", "bias_update_rate")
# How the forward is compiled, not what it computes:
_MODEL_NEUTRAL = ("scan_layers", "attention_impl")


# ------------------------------------------------------------------ pairs ---

def moe_layers_of(cfg: Config) -> list[int]:
  return [i for i in range(cfg.model.num_layers) if is_moe_layer(cfg, i)]


def layer_pairs(cfg: Config, d: int) -> list[tuple[int, int]]:
  """(src, dst) for every MoE layer dst with a layer d above it (src may be dense)."""
  return [(dst - d, dst) for dst in moe_layers_of(cfg) if dst - d >= 0]


def check_lookahead(cfg: Config, lookahead: list[int] | None) -> list[int]:
  """The lookahead distances to use, sorted; None: those of 1, 2, 3 the model has pairs for.
  Refuses a model without MoE layers and any d < 1, d >= num_layers or without a pair."""
  L = cfg.model.num_layers
  if not moe_layers_of(cfg):
    raise ValueError("the model has no MoE layer (every FFN is dense): no experts to prefetch")
  if lookahead is None:
    return [d for d in DEFAULT_LOOKAHEAD if d < L and layer_pairs(cfg, d)]
  for d in lookahead:
    if not 1 <= d < L:
      raise ValueError(f"--lookahead {d}: must be in [1, {L - 1}] (the model has {L} layers)")
    if not layer_pairs(cfg, d):
      raise ValueError(f"--lookahead {d}: no MoE layer is {d} layers below another layer "
                       f"(MoE layers: {moe_layers_of(cfg)})")
  return sorted(set(lookahead))


def next_token_pairs(cfg: Config) -> list[tuple[int, int]]:
  """(src, dst) for the next-token maps: every MoE dst at or below each MoE src."""
  moe = moe_layers_of(cfg)
  return [(src, dst) for src in moe for dst in moe if dst <= src]


def fetch_sizes(k: int) -> list[int]:
  """m = k, k + 1, 2k (distinct, ascending)."""
  return sorted({k, k + 1, 2 * k})


# ----------------------------------------------------------------- recall ---

def top_m_mask(scores_TE: np.ndarray, m: int) -> np.ndarray:
  """bool [T, E]: the m highest scores of each row (ties: lower expert index first)."""
  order_TE = np.argsort(-scores_TE, axis=-1, kind="stable")
  mask = np.zeros(scores_TE.shape, bool)
  np.put_along_axis(mask, order_TE[:, :min(m, scores_TE.shape[-1])], True, axis=-1)
  return mask


def recall_counts(scores_TE: np.ndarray, expert_TK: np.ndarray, used_TK: np.ndarray,
                  m: int) -> tuple[int, int]:
  """(hits, used): used (token, slot) pairs whose expert is among the token's top-m scores,
  and all used pairs; recall = hits / used (module doc)."""
  fetched_TK = np.take_along_axis(top_m_mask(scores_TE, m), expert_TK, axis=-1)
  return int((fetched_TK & used_TK).sum()), int(used_TK.sum())


# ------------------------------------------------------------- predictors ---

def expert_frequency(trace: RoutingTrace) -> np.ndarray:
  """float32 [L, E] (L: MoE layers): share of the trace's tokens that use each expert."""
  return np.stack([trace.used_TE(l).mean(0) for l in trace.moe_layers]).astype(np.float32)


class Frequency:
  name = "frequency"

  def __init__(self, frequency_LE: np.ndarray, moe_layers: tuple[int, ...]):
    self.frequency_LE, self.moe_layers = frequency_LE, tuple(moe_layers)

  def scores(self, trace: RoutingTrace, src: int, dst: int) -> np.ndarray:
    f_E = self.frequency_LE[self.moe_layers.index(dst)]
    return np.broadcast_to(f_E, (trace.num_tokens, f_E.shape[0]))


class PreviousToken:
  name = "previous"

  def __init__(self, frequency: Frequency):
    self.frequency = frequency

  def scores(self, trace: RoutingTrace, src: int, dst: int) -> np.ndarray:
    # Used experts score 2 + p > any unused one's p <= 1: used first, then by probability.
    prev_TE = 2.0 * trace.used_TE(dst) + trace.probs_LTE[trace.moe_index(dst)]
    out_TE = np.array(self.frequency.scores(trace, src, dst), np.float32)
    has_prev_T = trace.position_T > 0      # rows are batch-major: t - 1 is the same sequence
    out_TE[1:][has_prev_T[1:]] = prev_TE[:-1][has_prev_T[1:]]
    return out_TE


def _rms_normalize(h_TD: np.ndarray, eps: float) -> np.ndarray:
  h = h_TD.astype(np.float32)
  return h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps)


class LookaheadGate:
  name = "gate"

  def __init__(self, cfg: Config, layers: dict[int, dict[str, np.ndarray | None]], eps: float):
    """layers: per MoE layer {"scale_D": FFN norm scale, "router_DE", "bias_E" or None}."""
    self.mode, self.layers, self.eps = cfg.moe.routing, layers, eps

  @classmethod
  def from_model(cls, tm) -> "LookaheadGate":
    model = tm.module()
    layers = {}
    for i in model.moe_layers:
      b = model.blocks[i]
      layers[i] = {"scale_D": np.asarray(b.ffn_norm.scale[...], np.float32),
                   "router_DE": np.asarray(b.ffn.router_DE[...], np.float32),
                   "bias_E": None if b.ffn.bias_E is None else np.asarray(b.ffn.bias_E[...])}
    return cls(tm.cfg, layers, model.blocks[0].ffn_norm.eps)

  def scores(self, trace: RoutingTrace, src: int, dst: int) -> np.ndarray:
    p = self.layers[dst]
    logits_TE = (_rms_normalize(trace.hidden_LTD[src], self.eps) * p["scale_D"]) @ p["router_DE"]
    if self.mode == "topk_softmax":
      select_TE = logits_TE
    else:
      z_TE = np.exp(logits_TE - logits_TE.max(-1, keepdims=True))
      select_TE = z_TE / z_TE.sum(-1, keepdims=True)
    return select_TE if p["bias_E"] is None else select_TE + p["bias_E"]


def _ridge(x_TD: np.ndarray, y_TJ: np.ndarray, ridge: float) -> tuple[np.ndarray, np.ndarray]:
  """w = (Xc^T Xc / T + ridge I)^-1 Xc^T Yc / T, b = mean(Y) - mean(X) w (float64 inside)."""
  x_TD, y_TJ = x_TD.astype(np.float64), y_TJ.astype(np.float64)
  mx_D, my_J = x_TD.mean(0), y_TJ.mean(0)
  xc_TD, T = x_TD - mx_D, x_TD.shape[0]
  gram_DD = xc_TD.T @ xc_TD / T + ridge * np.eye(x_TD.shape[1])
  w_DJ = np.linalg.solve(gram_DD, xc_TD.T @ (y_TJ - my_J) / T)
  return w_DJ, my_J - mx_D @ w_DJ


def _fit_maps(x_of, y_of, pairs, E: int, ridge: float) -> dict:
  """One ridge solve per source layer over its targets' E columns each."""
  maps = {}
  for src in sorted({s for s, _ in pairs}):
    dsts = [d for s, d in pairs if s == src]
    w_DJ, b_J = _ridge(x_of(src), np.concatenate([y_of(d) for d in dsts], axis=1), ridge)
    for j, dst in enumerate(dsts):
      cols = slice(j * E, (j + 1) * E)
      maps[(src, dst)] = (w_DJ[:, cols].astype(np.float32), b_J[cols].astype(np.float32))
  return maps


class Learned:
  name = "learned"

  def __init__(self, maps: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]],
               eps: float = 1e-6, next_maps: dict | None = None):
    """maps: (src, dst) -> (w_DE, b_E); scores = rms_normalize(h_src) @ w_DE + b_E.
    next_maps: the same for dst's experts of the next token (may be empty)."""
    self.maps, self.eps, self.next_maps = maps, eps, dict(next_maps or {})

  @classmethod
  def fit(cls, trace: RoutingTrace, pairs: list[tuple[int, int]], ridge: float = DEFAULT_RIDGE,
          eps: float = 1e-6, next_pairs: list[tuple[int, int]] = ()) -> "Learned":
    """Ridge regression per pair to the multi-hot of the used experts, one Gram matrix per
    source layer; next_pairs on the rows whose next token is in the same sequence."""
    E = trace.probs_LTE.shape[-1]
    x_of = lambda src: _rms_normalize(trace.hidden_LTD[src], eps)
    maps = _fit_maps(x_of, trace.used_TE, pairs, E, ridge)
    has_next_T = np.append(trace.position_T[1:] > 0, False)   # row t + 1 continues row t
    next_maps = _fit_maps(lambda src: x_of(src)[has_next_T],
                          lambda dst: np.roll(trace.used_TE(dst), -1, axis=0)[has_next_T],
                          next_pairs, E, ridge) if has_next_T.any() else {}
    return cls(maps, eps, next_maps)

  def scores(self, trace: RoutingTrace, src: int, dst: int) -> np.ndarray:
    w_DE, b_E = self.maps[(src, dst)]
    return _rms_normalize(trace.hidden_LTD[src], self.eps) @ w_DE + b_E

  def next_scores(self, hidden_TD: np.ndarray, src: int, dst: int) -> np.ndarray:
    """Scores of dst's experts for the token after each row's (the regression's estimate of
    the chance each is used), from the rows' residual at src."""
    w_DE, b_E = self.next_maps[(src, dst)]
    return _rms_normalize(hidden_TD, self.eps) @ w_DE + b_E


class NextToken:
  """Evaluation view of Learned's next-token maps: row t's scores are its prediction for the
  token after it at dst, from src = dst (the earliest the estimate is made)."""
  name = "learned, next token"

  def __init__(self, learned: Learned):
    self.learned = learned

  def scores(self, trace: RoutingTrace, src: int, dst: int) -> np.ndarray:
    return self.learned.next_scores(trace.hidden_LTD[src], src, dst)


# ------------------------------------------------------ the stored predictor ---

def model_digest(tm) -> str:
  """Identifies the model a predictor belongs to: its routing settings and every MoE
  layer's FFN norm scale, router and selection bias (the learned maps read hidden states
  that all weights shape, but a different model has different routers)."""
  h = hashlib.sha256()
  c = tm.cfg.to_dict()
  moe = {k: v for k, v in c["moe"].items() if k not in _ROUTING_NEUTRAL}
  model = {k: v for k, v in c["model"].items() if k not in _MODEL_NEUTRAL}
  h.update(json.dumps({"model": model, "moe": moe}, sort_keys=True).encode())
  for i, p in sorted(LookaheadGate.from_model(tm).layers.items()):
    for name in ("scale_D", "router_DE", "bias_E"):
      if p[name] is not None:
        h.update(f"{i}.{name}".encode()), h.update(np.ascontiguousarray(p[name]).tobytes())
  return h.hexdigest()[:16]


def save_predictor(run_dir: Path, learned: Learned, frequency: Frequency, meta: dict) -> Path:
  """predictor.npz (maps, training-split frequency, metadata as JSON inside: one file, one
  rename) and predictor.json, a readable copy of the metadata."""
  from moejax.atomic import write_atomic
  arrays = {"frequency_LE": frequency.frequency_LE,
            "moe_layers": np.asarray(frequency.moe_layers, np.int32),
            "meta_json": np.asarray(json.dumps(meta))}
  for (src, dst), (w_DE, b_E) in learned.maps.items():
    arrays[f"w_DE_{src}_{dst}"], arrays[f"b_E_{src}_{dst}"] = w_DE, b_E
  for (src, dst), (w_DE, b_E) in learned.next_maps.items():
    arrays[f"next_w_DE_{src}_{dst}"], arrays[f"next_b_E_{src}_{dst}"] = w_DE, b_E
  path = Path(run_dir) / PREDICTOR_FILE
  tmp = path.with_suffix(".tmp.npz")
  np.savez(tmp, **arrays)
  tmp.replace(path)
  write_atomic(Path(run_dir) / PREDICTOR_META, json.dumps(meta, indent=2))
  return path


def load_predictor(run_dir: Path, tm, lookahead: list[int]) -> tuple[Learned, Frequency, dict]:
  """The run's stored predictor, refused unless it was trained on this model at this step
  for every lookahead asked."""
  path = Path(run_dir) / PREDICTOR_FILE
  retrain = f"retrain it: moejax train-predictor {run_dir}"
  try:
    with np.load(path) as f:
      meta = json.loads(str(f["meta_json"]))
      arrays = {k: f[k] for k in f.files}
    if not {"model_digest", "step", "lookahead", "pairs", "eps"} <= meta.keys():
      raise KeyError("metadata")
  except (KeyError, OSError, ValueError) as err:   # not ours, an older layout, truncated
    raise ValueError(f"{path} is not a predictor file of this version ({err!r}); "
                     f"{retrain}") from None
  if meta["model_digest"] != model_digest(tm) or meta["step"] != tm.step:
    raise ValueError(f"{path} was trained on another model or checkpoint (step "
                     f"{meta['step']}, model {meta['model_digest']}; this run: step {tm.step}, "
                     f"model {model_digest(tm)}); {retrain}")
  missing = sorted(set(lookahead) - set(meta["lookahead"]))
  if missing:
    both = sorted(set(lookahead) | set(meta["lookahead"]))
    raise ValueError(f"{path} holds lookahead {meta['lookahead']}, not {missing}; {retrain} "
                     f"--lookahead {' '.join(map(str, both))}")
  try:
    maps = {(s, d): (arrays[f"w_DE_{s}_{d}"], arrays[f"b_E_{s}_{d}"]) for s, d in meta["pairs"]}
    next_maps = {(s, d): (arrays[f"next_w_DE_{s}_{d}"], arrays[f"next_b_E_{s}_{d}"])
                 for s, d in meta.get("next_pairs", [])}
    freq = Frequency(arrays["frequency_LE"], tuple(int(l) for l in arrays["moe_layers"]))
  except KeyError as err:
    raise ValueError(f"{path} lacks {err}; {retrain}") from None
  return Learned(maps, meta["eps"], next_maps), freq, meta
