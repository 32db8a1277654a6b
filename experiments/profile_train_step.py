"""Where a training step's time goes: the GPU kernels of bench_train_step's model step, from a
jax.profiler trace, per kernel and per source (the jax op's file: attention.py, moe.py,
optax's transforms, ...), divided by the traced steps.

    python3 experiments/profile_train_step.py [--size 1b] [--impl gmm] [--steps 3] [key=value ...]

Prints the busy kernel time against the step's wall time, the sums per source file, and the
top kernels; writes JSON to $OUT/profile_train_step.json when OUT is set.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _trace import fusion_sources, gpu_kernels  # noqa: E402
from bench_train_step import SIZES, SMOKE, train_config  # noqa: E402
from moejax.state import init_state, make_train_step  # noqa: E402


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("overrides", nargs="*")
  ap.add_argument("--size", default="1b", choices=sorted(SIZES))
  ap.add_argument("--impl", default="gmm")
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--top", type=int, default=30)
  ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: no GPU kernels)")
  args = ap.parse_args()
  cfg = train_config(args.size, args.impl, (SMOKE if args.smoke else []) + list(args.overrides))
  graphdef, state = init_state(cfg)
  step = jax.jit(make_train_step(cfg, graphdef), donate_argnums=0)
  B, T = cfg.data.batch_size, cfg.data.seq_len
  x = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (B, T + 1)).astype(np.int32)
  inputs, targets = x[:, :-1], x[:, 1:]
  compiled = step.lower(state, inputs, targets).compile()
  sources = fusion_sources(compiled.as_text())
  for _ in range(2):
    state, m = compiled(state, inputs, targets)
  jax.block_until_ready(m)
  trace_dir = tempfile.mkdtemp()
  with jax.profiler.trace(trace_dir):
    t0 = time.perf_counter()
    for _ in range(args.steps):
      state, m = compiled(state, inputs, targets)
    jax.block_until_ready(m)
    wall_s = time.perf_counter() - t0
  kernels = gpu_kernels(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
  if not kernels:
    print(f"no GPU kernels in the trace ({jax.devices()[0].platform}): wall "
          f"{wall_s / args.steps * 1e3:.1f} ms/step")
    return
  n = args.steps
  by_kernel = collections.defaultdict(lambda: [0, 0])
  by_source = collections.defaultdict(lambda: [0, 0])
  for name, op, long_name, _, dur in kernels:
    src = sources.get(name, long_name)
    by_kernel[(name, src)][0] += dur
    by_kernel[(name, src)][1] += 1
    file = src.split()[-1].split(":")[0] if ":" in src else (src.split() or ["?"])[0]
    by_source[file][0] += dur
    by_source[file][1] += 1
  busy = max(sum(k[4] for k in kernels), 1)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; size {args.size}, impl "
        f"{args.impl}, {n} steps: wall {wall_s / n * 1e3:.1f} ms/step, kernels busy "
        f"{busy / n / 1e6:.1f} ms/step, {len(kernels) / n:.0f} kernels/step")
  print(f"{'ms/step':>8s} {'%busy':>6s} {'kernels':>7s}  source")
  for file, (dur, cnt) in sorted(by_source.items(), key=lambda kv: -kv[1][0]):
    print(f"{dur / n / 1e6:8.2f} {100 * dur / busy:6.1f} {cnt / n:7.0f}  {file}")
  print(f"\n{'ms/step':>8s} {'%busy':>6s} {'launch':>6s}  kernel  [op source]")
  rows = sorted(((v[0], v[1], k[0], k[1]) for k, v in by_kernel.items()), reverse=True)
  for dur, cnt, name, src in rows[:args.top]:
    print(f"{dur / n / 1e6:8.2f} {100 * dur / busy:6.1f} {cnt / n:6.0f}  {name[:50]}  {src[:90]}")
  if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "profile_train_step.json"), "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, args=vars(args),
                     wall_ms=wall_s / n * 1e3, busy_ms=busy / n / 1e6,
                     sources={k: v[0] / n / 1e6 for k, v in by_source.items()},
                     rows=[dict(ms=d / n / 1e6, launches=c / n, kernel=k, source=s)
                           for d, c, k, s in rows]), f, indent=1)


if __name__ == "__main__":
  main()
