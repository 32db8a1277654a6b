"""`moejax train-predictor` and `moejax eval-prefetch`: the learned prefetch predictor of a
run (trained on a training-split routing trace, stored as RUN_DIR/predictor.npz) and the
recall of every predictor (prefetch.py) on held-out text, written to RUN_DIR/prefetch.json
and prefetch.png. Every refusal (no run, a dense model, a bad lookahead, a predictor of
another model or step) happens before anything is written.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from moejax.checkpoint import load_run_config
from moejax.config import Config, with_overrides
from moejax.inference.prefetch import (
    DEFAULT_RIDGE, PREDICTOR_FILE, Frequency, Learned, LookaheadGate, NextToken, PreviousToken,
    check_lookahead, expert_frequency, fetch_sizes, layer_pairs, load_predictor, model_digest,
    next_token_pairs, recall_counts, save_predictor)
from moejax.inference.routing_trace import RoutingTrace, record_trace, trace_windows
from moejax.model import routing

RESULT_FILE, PLOT_FILE = "prefetch.json", "prefetch.png"
DEFAULT_TOKENS = 16384


def checked_config(run_dir: Path, overrides: list[str] | None, lookahead: list[int] | None,
                   tokens: int) -> tuple[Config, list[int]]:
  """The run's config and lookahead, refused before any weight is loaded."""
  if tokens < 1:
    raise ValueError(f"--tokens {tokens}: must be >= 1")
  if not (Path(run_dir) / "checkpoints").is_dir():
    raise FileNotFoundError(f"{run_dir} is not a run directory (no checkpoints/ inside)")
  cfg = with_overrides(load_run_config(Path(run_dir)), overrides or [])
  return cfg, check_lookahead(cfg, lookahead)


def _load(run_dir: Path, overrides):
  from moejax.inference.load import load_trained
  from moejax.run_io import load_data
  tm = load_trained(run_dir, overrides)
  return tm, load_data(tm.cfg, run_dir)


def _trace(tm, data, split: str, tokens: int) -> RoutingTrace:
  d = tm.cfg.data
  return record_trace(tm, trace_windows(data, split, tokens, d.batch_size, d.seq_len))


def fit_predictor(tm, data, lookahead: list[int], tokens: int, ridge: float
                  ) -> tuple[Learned, Frequency, dict]:
  """The learned maps for every (src, dst) pair of `lookahead` and the expert frequency,
  both from one training-split trace of about `tokens` tokens."""
  trace = _trace(tm, data, "train", tokens)
  pairs = [p for d in lookahead for p in layer_pairs(tm.cfg, d)]
  next_pairs = next_token_pairs(tm.cfg)
  learned = Learned.fit(trace, pairs, ridge, next_pairs=next_pairs)
  meta = {"step": tm.step, "model_digest": model_digest(tm), "lookahead": lookahead,
          "pairs": [list(p) for p in pairs], "next_pairs": [list(p) for p in next_pairs],
          "train_tokens": trace.num_tokens, "ridge": ridge,
          "eps": learned.eps,
          "features": "RMS-normalized (no scale) residual after the source layer's attention",
          "target": "multi-hot of the target layer's used experts (ridge regression)"}
  return learned, Frequency(expert_frequency(trace), trace.moe_layers), meta


def train_predictor_run(run_dir: str | Path, lookahead: list[int] | None = None,
                        tokens: int = DEFAULT_TOKENS, ridge: float = DEFAULT_RIDGE,
                        overrides: list[str] | None = None) -> tuple[dict, Path]:
  run_dir = Path(run_dir)
  if not ridge > 0:
    raise ValueError(f"--ridge {ridge}: must be > 0")
  _, lookahead = checked_config(run_dir, overrides, lookahead, tokens)
  tm, data = _load(run_dir, overrides)
  learned, freq, meta = fit_predictor(tm, data, lookahead, tokens, ridge)
  return meta, save_predictor(run_dir, learned, freq, meta)


NEXT = "next"   # the lookahead label of the next-token rows


def _summed(per_layer: list[dict], name: str, d, ms: list[int]) -> list[dict]:
  out = []
  for m in ms:
    mine = [r for r in per_layer if r["m"] == m]
    out.append({"predictor": name, "lookahead": d, "m": m, "layer": "all", "source_layer": None,
                "hits": sum(r["hits"] for r in mine), "used": sum(r["used"] for r in mine)})
  return out


def evaluate_recall(trace: RoutingTrace, predictors: list, cfg: Config,
                    lookahead: list[int], next_token: list | None = None) -> list[dict]:
  """One row per (predictor, d, m, target layer), then per (predictor, d, m) over all
  target layers ("layer": "all": hits and used experts summed). next_token: predictors
  whose row-t scores at (dst, dst) rank dst's experts of token t itself as known from
  token t - 1 (PreviousToken, Frequency, NextToken shifted by one row), scored on the rows
  that have a previous token, as lookahead "next"."""
  ms = fetch_sizes(routing.slots_per_token(cfg.moe))
  rows = []
  for p in predictors:
    for d in lookahead:
      per_layer = []
      for src, dst in layer_pairs(cfg, d):
        i = trace.moe_index(dst)
        scores_TE = p.scores(trace, src, dst)
        for m in ms:
          hits, used = recall_counts(scores_TE, trace.expert_LTK[i], trace.used_LTK[i], m)
          per_layer.append({"predictor": p.name, "lookahead": d, "m": m, "layer": dst,
                            "source_layer": src, "hits": hits, "used": used})
      rows += per_layer + _summed(per_layer, p.name, d, ms)
  has_prev_T = trace.position_T > 0
  for p in next_token or []:
    per_layer = []
    for dst in trace.moe_layers:
      i = trace.moe_index(dst)
      scores_TE = p.scores(trace, dst, dst)
      if isinstance(p, NextToken):   # row t predicts row t + 1
        scores_TE = np.roll(scores_TE, 1, axis=0)
      for m in ms:
        hits, used = recall_counts(scores_TE[has_prev_T], trace.expert_LTK[i][has_prev_T],
                                   trace.used_LTK[i][has_prev_T], m)
        per_layer.append({"predictor": p.name, "lookahead": NEXT, "m": m, "layer": dst,
                          "source_layer": dst, "hits": hits, "used": used})
    rows += per_layer + _summed(per_layer, p.name, NEXT, ms)
  for r in rows:
    r["recall"] = r["hits"] / r["used"] if r["used"] else None
  return rows


def eval_prefetch_run(run_dir: str | Path, lookahead: list[int] | None = None,
                      tokens: int = DEFAULT_TOKENS, overrides: list[str] | None = None
                      ) -> tuple[dict, dict[str, str]]:
  """Recall of every predictor on about `tokens` held-out tokens. Uses RUN_DIR/predictor.npz,
  training it first (and keeping it, as train-predictor would) when there is none."""
  from moejax.atomic import write_atomic
  run_dir = Path(run_dir)
  cfg, lookahead = checked_config(run_dir, overrides, lookahead, tokens)
  tm, data = _load(run_dir, overrides)
  if (run_dir / PREDICTOR_FILE).is_file():
    learned, freq, meta = load_predictor(run_dir, tm, lookahead)
  else:
    print(f"note: no {run_dir / PREDICTOR_FILE}: training one on the training split "
          f"(as moejax train-predictor --lookahead {' '.join(map(str, lookahead))})",
          file=sys.stderr)
    learned, freq, meta = fit_predictor(tm, data, lookahead, tokens, DEFAULT_RIDGE)
    save_predictor(run_dir, learned, freq, meta)
  trace = _trace(tm, data, "val", tokens)
  previous = PreviousToken(freq)
  predictors = [LookaheadGate.from_model(tm), learned, previous, freq]
  next_token = ([NextToken(learned)] if learned.next_maps else []) + [previous, freq]
  rows = evaluate_recall(trace, predictors, cfg, lookahead, next_token)
  result = {"step": tm.step, "val_tokens": trace.num_tokens, "train_tokens": meta["train_tokens"],
            "top_k": routing.slots_per_token(cfg.moe), "num_experts": cfg.moe.num_experts,
            "fetch_sizes": fetch_sizes(routing.slots_per_token(cfg.moe)),
            "lookahead": lookahead, "overrides": list(overrides or []), "rows": rows}
  json_path = run_dir / RESULT_FILE
  write_atomic(json_path, json.dumps(result, indent=2, allow_nan=False))
  png = plot_recall(rows, run_dir / f".{PLOT_FILE}.tmp.png").replace(run_dir / PLOT_FILE)
  return result, {"json": str(json_path), "plot": str(png)}


def _grid(header: list[str], body: list[list[str]]) -> str:
  widths = [max(len(x[i]) for x in body + [header]) for i in range(len(header))]
  fmt = lambda x: "  ".join(c.rjust(w) for c, w in zip(x, widths))
  return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(x) for x in body])


def _pct(r: dict | None) -> str:
  return "n/a" if r is None or r["recall"] is None else f"{r['recall']:.4f}"


def format_table(rows: list[dict]) -> str:
  """Overall recall per (predictor, d) by m, then per target layer at m = k."""
  ms = sorted({r["m"] for r in rows})
  key = {(r["predictor"], r["lookahead"], r["m"], r["layer"]): r for r in rows}
  groups = list(dict.fromkeys((r["predictor"], r["lookahead"]) for r in rows))
  overall = _grid(["predictor", "d"] + [f"recall m={m}" for m in ms],
                  [[p, str(d)] + [_pct(key.get((p, d, m, "all"))) for m in ms]
                   for p, d in groups])
  layers = sorted({r["layer"] for r in rows if r["layer"] != "all"})
  per_layer = _grid(["predictor", "d"] + [f"layer {l}" for l in layers],
                    [[p, str(d)] + [_pct(key.get((p, d, ms[0], l))) for l in layers]
                     for p, d in groups])
  return f"{overall}\n\nper target layer, m={ms[0]}:\n{per_layer}"


def plot_recall(rows: list[dict], path: Path) -> Path:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  overall = [r for r in rows if r["layer"] == "all"]
  ds = sorted({r["lookahead"] for r in overall} - {NEXT})
  ds += [NEXT] if any(r["lookahead"] == NEXT for r in overall) else []
  names = list(dict.fromkeys(r["predictor"] for r in overall))
  fig, axes = plt.subplots(1, len(ds), figsize=(3.2 * len(ds) + 1, 3.4), squeeze=False,
                           sharey=True)
  for ax, d in zip(axes[0], ds):
    for name in names:
      pts = sorted((r["m"], r["recall"]) for r in overall
                   if r["lookahead"] == d and r["predictor"] == name and r["recall"] is not None)
      ax.plot(*np.array(pts).T, "o-", label=name)
    ax.set_xticks(sorted({r["m"] for r in overall}))
    ax.set_title("layer L, next token" if d == NEXT else f"layer L+{d} from layer L")
    ax.set_xlabel("experts fetched (m)")
    ax.grid(alpha=0.3)
  axes[0][0].set_ylabel("recall of the used experts")
  axes[0][-1].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
