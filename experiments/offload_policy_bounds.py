"""How many expert fetches per token each offload policy needs, against two bounds, replayed
on the routing of a trained run's own sampled continuation (CPU or GPU; no timing).

  lru / lfu / predictive   OffloadCache's policies on demand (no prefetch; predictive with
                           its frequency estimate only);
  within-token oracle      predictive told each token's true experts for its remaining layers
                           (a perfect lookahead predictor at d = all) as its wish list;
  Belady                   the offline optimum: evict what is next needed furthest ahead,
                           knowing the routing of every later token;
  Belady h=N               the same knowing only the rest of the token and the next N
                           tokens (experts not needed within them go first, least recently
                           used first): what N tokens of perfect foresight are worth.
The oracle's gap to Belady is what no lookahead predictor inside a token can recover: the
experts of the next tokens.

  python experiments/offload_policy_bounds.py RUN_DIR [--tokens 200] [--budgets 25 50 75]
Prints fetches per token; writes JSON to $OUT/offload_policy_bounds.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from moejax.inference.load import load_trained  # noqa: E402
from moejax.inference.offload import OffloadModel  # noqa: E402
from moejax.inference.offload_cache import OffloadCache  # noqa: E402
from moejax.inference.offload_engine import OffloadEngine  # noqa: E402
from moejax.inference.sampling import SamplingConfig  # noqa: E402
from moejax.model import routing  # noqa: E402
from moejax.run_io import load_data  # noqa: E402


def decode_routing(run_dir: str, tokens: int, prompt_len: int, seed: int):
  """[(layer, experts used)] of each decode step's MoE layers in order, and the model."""
  tm = load_trained(run_dir)
  om = OffloadModel.from_split(tm.cfg, tm.graphdef, tm.params, tm.buffers, None)
  val = load_data(tm.cfg, Path(run_dir)).val
  start = int(np.random.default_rng(seed).integers(0, len(val) - prompt_len))
  eng = OffloadEngine(om, slots=len(om.moe_layers) * om.num_experts, record=True)
  eng.generate([val[start:start + prompt_len].tolist()], tokens,
               sampling=SamplingConfig(0.8, 40, 1.0), seed=seed)
  seq = [(l, np.flatnonzero(used.any(0)).tolist())
         for (pos, l), used in sorted(eng.routing_log.items()) if pos >= prompt_len]
  return seq, om


def replay(seq, slots, policy, layers, prior, wish_layers=0) -> int:
  """Fetches of `policy` over seq; wish_layers > 0: the true experts of the token's next
  wish_layers layers are its wish list (the within-token oracle)."""
  cache = OffloadCache(slots, policy, layers=layers, use_prior=prior)
  n = len(layers)
  for i, (l, es) in enumerate(seq):
    cache.visit(l)
    cache.acquire([(l, e) for e in es])
    cache.release()
    if wish_layers:
      end = min(i + 1 + wish_layers, (i // n + 1) * n)
      cache.want([(seq[j][0], e) for j in range(i + 1, end) for e in seq[j][1]])
  return cache.stats.misses + cache.stats.prefetches


def belady(seq, slots, horizon=None, layers_per_token=1) -> int:
  """Fetches of the offline optimum; horizon=N: knowing only the rest of the current token
  and the next N tokens (seq holds layers_per_token entries per token)."""
  flat = [(l, e) for l, es in seq for e in es]
  token = [i // layers_per_token for i, (_, es) in enumerate(seq) for _ in es]
  next_at, nxt = [0] * len(flat), {}
  for i in range(len(flat) - 1, -1, -1):
    next_at[i], nxt[flat[i]] = nxt.get(flat[i], float("inf")), i
  seen_end = {}  # token t -> first flat index past token t + horizon (none: all in sight)
  for i, t in enumerate(token if horizon is not None else ()):
    seen_end[t - horizon] = i + 1
  cache, fetches = {}, 0  # key -> (next use, last use)
  for i, key in enumerate(flat):
    if key not in cache:
      fetches += 1
      if len(cache) >= slots:
        limit = seen_end.get(token[i], len(flat))
        # Within sight: evict the furthest next use; out of sight first, least recent first.
        rank = lambda k: (1, -cache[k][1]) if cache[k][0] >= limit else (0, cache[k][0])
        del cache[max(cache, key=rank)]
    cache[key] = (next_at[i], i)
  return fetches


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("run_dir")
  p.add_argument("--tokens", type=int, default=200, help="decode steps replayed")
  p.add_argument("--prompt", type=int, default=16)
  p.add_argument("--budgets", type=int, nargs="+", default=[25, 50, 75])
  p.add_argument("--horizons", type=int, nargs="*", default=[1, 2, 4, 8],
                 help="Belady with N tokens of foresight, for each N")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  if any(h < 0 for h in a.horizons):
    p.error(f"--horizons: token counts must be >= 0, got {a.horizons}")
  seq, om = decode_routing(a.run_dir, a.tokens, a.prompt, a.seed)
  layers, total = om.moe_layers, len(om.moe_layers) * om.num_experts
  prior = routing.slots_per_token(om.cfg.moe) / om.num_experts
  steps = len(seq) // len(layers)
  cols = (["lru", "lfu", "predictive", "within-token oracle"]
          + [f"Belady h={h}" for h in a.horizons] + ["Belady"])
  result = dict(run=a.run_dir, steps=steps, moe_layers=len(layers), experts=om.num_experts,
                rows=[])
  print(f"{a.run_dir}: {steps} decode steps, {len(layers)} MoE layers x {om.num_experts} "
        "experts; expert fetches per token")
  print(f"{'budget':>6s} {'slots':>5s} " + " ".join(f"{c:>19s}" for c in cols))
  for pct in a.budgets:
    slots = max(1, round(pct / 100 * total))
    f = [replay(seq, slots, pol, layers, prior) for pol in ("lru", "lfu", "predictive")]
    f += [replay(seq, slots, "predictive", layers, prior, wish_layers=len(layers))]
    f += [belady(seq, slots, h, len(layers)) for h in a.horizons] + [belady(seq, slots)]
    row = dict(budget_pct=pct, slots=slots, **{c: v / steps for c, v in zip(cols, f)})
    result["rows"].append(row)
    print(f"{pct:5d}% {slots:5d} " + " ".join(f"{row[c]:19.2f}" for c in cols))
  out = a.out or os.path.join(os.environ.get("OUT", "."), "offload_policy_bounds.json")
  with open(out, "w") as fh:
    json.dump(result, fh, indent=1)
  return result


if __name__ == "__main__":
  main()
