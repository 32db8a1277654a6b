"""Where a decode step's time goes: the GPU kernels of `moejax bench-decode`'s loop, from a
jax.profiler trace, summed per kernel and divided by steps (and layers).

    python3 experiments/profile_decode.py configs/mixtral_8x7b.yaml --expert-bits 4 \
        --kv-bits 2 --batch 1 --context 32768 --layers 4 --steps 20 [key=value ...]

Prints one line per kernel (µs per step, launches per step, share of the busy time), the
busy time against the wall time of the traced loop (the difference: gaps between kernels),
and writes the rows as JSON to $OUT/profile_decode.json when OUT is set.
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
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _trace import fusion_sources, gpu_kernels  # noqa: E402
from moejax.config import load_config, with_overrides  # noqa: E402
from moejax.inference.bench_decode import (Case, _decode_program, case_config,  # noqa: E402
                                           random_caches)
from moejax.inference.load import decode_layout  # noqa: E402
from moejax.state import build_model, split_model  # noqa: E402


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("config")
  ap.add_argument("overrides", nargs="*")
  ap.add_argument("--expert-bits", type=int, default=4)
  ap.add_argument("--kv-bits", type=int, default=2)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--context", type=int, default=32768)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--top", type=int, default=40)
  args = ap.parse_args()
  case = Case(args.expert_bits, args.kv_bits, args.batch, args.context, "gmm", args.layers, "")
  cfg = case_config(with_overrides(load_config(args.config), args.overrides), case)
  graphdef, params, buffers = decode_layout(*split_model(build_model(cfg, 0)))
  key = jax.random.key(0)
  caches = random_caches(cfg, case.batch, case.context, case.context + args.steps + 1, key)
  feed_B = jnp.zeros((case.batch,), jnp.int32)
  program = _decode_program(graphdef)
  call_args = (params, buffers, caches, feed_B, jnp.int32(case.context), jnp.int32(args.steps))
  compiled = program.lower(*call_args).compile()
  sources = fusion_sources(compiled.as_text())
  for _ in range(2):
    jax.block_until_ready(compiled(*call_args))
  trace_dir = tempfile.mkdtemp()
  with jax.profiler.trace(trace_dir):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*call_args))
    wall_s = time.perf_counter() - t0
  kernels = gpu_kernels(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
  n, L = args.steps, args.layers
  by_name = collections.defaultdict(lambda: [0, 0, ""])
  for name, op, long_name, _, dur in kernels:
    row = by_name[(name, op)]
    row[0] += dur
    row[1] += 1
    row[2] = long_name
  busy_ns = sum(k[4] for k in kernels)
  span_ns = (max(k[3] + k[4] for k in kernels) - min(k[3] for k in kernels)) if kernels else 0
  busy_ns = max(busy_ns, 1)
  rows = sorted(((v[0], v[1], name, op, v[2]) for (name, op), v in by_name.items()), reverse=True)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; {L} layers, B={case.batch}, "
        f"S={case.context}, experts int{case.expert_bits}, KV {case.kv_bits}-bit, {n} steps")
  print(f"kernels per step {len(kernels) / n:.1f}; busy {busy_ns / n / 1e3:.1f} µs/step, "
        f"span {span_ns / n / 1e3:.1f} µs/step, host wall {wall_s / n * 1e6:.1f} µs/step")
  print(f"{'µs/step':>9s} {'µs/layer':>9s} {'launch/step':>11s} {'%busy':>6s}  kernel [hlo op]")
  for dur, count, name, op, long_name in rows[:args.top]:
    print(f"{dur / n / 1e3:9.2f} {dur / n / L / 1e3:9.2f} {count / n:11.1f} "
          f"{100 * dur / busy_ns:6.1f}  {name[:40]}  {sources.get(name, long_name)[:110]}")
  if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "profile_decode.json"), "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, args=vars(args),
                     busy_us_per_step=busy_ns / n / 1e3, span_us_per_step=span_ns / n / 1e3,
                     rows=[dict(us_per_step=d / n / 1e3, launches_per_step=c / n, kernel=nm,
                                hlo_op=op, source=sources.get(nm, ln)) for d, c, nm, op, ln in rows]),
                f, indent=1)


if __name__ == "__main__":
  main()
