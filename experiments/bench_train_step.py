"""Train-step time and MFU of an MoE model with expert_impl gmm vs dense vs ragged; or the
compile time of a deep training step (--compile-only-layers).

Run on the GPU machine:  PYTHONPATH=. python3 experiments/bench_train_step.py
    [--size 1b|olmoe] [--remat none|experts|full] [--scan-layers] [key=value ...]
    PYTHONPATH=. python3 experiments/bench_train_step.py --compile-only-layers 32

Sizes (`--size`):
  1b     1.1B parameters (0.43B active): L = 6, D = 2048, E = 8 top-2, F = 3072, B x T = 8 x 2048.
  olmoe  configs/olmoe_1b_7b.yaml's layer (D = 2048, 16 heads, E = 64 top-8, F = 1024,
         V = 50304) at L = 4 and B x T = 4 x 2048: the 16 layers (6.9B parameters) need
         ~110 GB for float32 parameters, gradients and AdamW moments alone; 4 layers
         (1.9B, ~30 GB of state) leave an 80 GB H100 room for the activations without remat.
         More layers fit with train.remat=full: e.g. `model.num_layers=8 --remat full`.
MFU = model FLOPs (6 x active params x tokens + attention) / step time / bf16 matmul rate
measured in the same run (8192^3 random bf16 matmul).

--compile-only-layers N: lowers and compiles (nothing runs, nothing of the model's size is
allocated: the state is jax.ShapeDtypeStruct) the training step of configs/mixtral_8x7b.yaml's
shape at N layers, with model.scan_layers false and true, and reports both times. With
--smoke the shape is the smoke one at N layers (a CPU-sized check of the same path).
`key=value` overrides apply last, to every mode.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import REMATS, Config, load_config
from moejax.inference.timing import median_seconds
from moejax.model.transformer import active_params
from moejax.state import abstract_state, init_state, make_train_step

REPO = Path(__file__).resolve().parents[1]
SIZES = {
    "1b": ["model.vocab_size=32000", "model.d_model=2048", "model.num_layers=6",
           "model.num_heads=16", "model.num_kv_heads=8", "model.head_dim=128",
           "model.ffn_hidden=8192", "model.max_seq_len=2048", "model.tie_embeddings=false",
           "model.dtype=bfloat16", "model.param_dtype=float32", "moe.num_experts=8",
           "moe.top_k=2", "moe.expert_hidden=3072", "data.seq_len=2048", "data.batch_size=8",
           "data.tokenizer=bpe", "data.bpe_vocab_size=32000"],
    # configs/olmoe_1b_7b.yaml, 4 of its 16 layers (module doc).
    "olmoe": ["model.vocab_size=50304", "model.d_model=2048", "model.num_layers=4",
              "model.num_heads=16", "model.num_kv_heads=16", "model.head_dim=128",
              "model.ffn_hidden=1024", "model.max_seq_len=2048", "model.norm_eps=1e-5",
              "model.tie_embeddings=false", "model.dtype=bfloat16", "model.param_dtype=float32",
              "moe.num_experts=64", "moe.top_k=8", "moe.expert_hidden=1024",
              "moe.renormalize=false", "data.seq_len=2048", "data.batch_size=4",
              "data.tokenizer=bpe", "data.bpe_vocab_size=50304"],
}
SMOKE = ["model.d_model=64", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
         "model.head_dim=32", "model.ffn_hidden=128", "moe.expert_hidden=64",
         "model.vocab_size=512", "data.bpe_vocab_size=512", "data.seq_len=64",
         "data.batch_size=2", "model.max_seq_len=64"]


def train_config(size: str, impl: str, overrides: list[str]) -> Config:
  """The benchmarked config: SIZES[size] with `impl`, then the overrides."""
  # dense = capacity einsum: a dropless buffer would be tokens x tokens, so cf 1.25.
  cf = ["moe.capacity_factor=1.25"] if impl == "dense" else []
  return load_config(None, SIZES[size] + [f"moe.expert_impl={impl}"] + cf + list(overrides))


def matmul_tflops(n=8192, reps=10):
  """bf16 n^3 matmul rate, back-to-back calls (bench_gmm's ceiling): a sync after every
  1.4 ms call read 610-673 TFLOP/s where back-to-back calls read 778 (H100, 2026-12-07)."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  return 2 * n ** 3 / median_seconds(jax.jit(lambda a, b: a @ b), (a, b), reps=reps) / 1e12


def time_impl(cfg: Config, steps: int):
  graphdef, state = init_state(cfg)
  n_params = sum(x.size for x in jax.tree.leaves(state.params))
  step = jax.jit(make_train_step(cfg, graphdef), donate_argnums=0)
  B, T = cfg.data.batch_size, cfg.data.seq_len
  rng = np.random.default_rng(0)
  batches = [rng.integers(0, cfg.model.vocab_size, (B, T + 1)).astype(np.int32) for _ in range(4)]
  t0 = time.perf_counter()
  state, m = step(state, batches[0][:, :-1], batches[0][:, 1:])
  jax.block_until_ready(m)
  compile_s = time.perf_counter() - t0
  times = []
  for i in range(steps):
    x = batches[i % 4]
    t = time.perf_counter()
    state, m = step(state, x[:, :-1], x[:, 1:])
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t)
  m_ = cfg.model
  attn_flops = 12 * m_.num_layers * B * T * T * m_.num_heads * m_.head_dim / 2  # causal half
  flops = 6 * active_params(cfg) * B * T + attn_flops
  peak_bytes = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
  return {"impl": cfg.moe.expert_impl, "remat": cfg.train.remat,
          "scan_layers": cfg.model.scan_layers, "params": int(n_params),
          "active_params": active_params(cfg), "tokens": B * T, "compile_s": compile_s,
          "step_ms": 1e3 * float(np.median(times)), "step_flops": flops,
          "peak_gb": peak_bytes / 2 ** 30 if peak_bytes else None, "loss": float(m["loss"])}


def compile_time(cfg: Config) -> dict:
  """Lower + compile of the training step on abstract inputs (nothing allocated)."""
  t0 = time.perf_counter()
  graphdef, state = abstract_state(cfg)
  tokens = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.data.seq_len), jnp.int32)
  lowered = jax.jit(make_train_step(cfg, graphdef), donate_argnums=0).lower(state, tokens, tokens)
  t1, c1 = time.perf_counter(), time.process_time()
  lowered.compile()
  t2, c2 = time.perf_counter(), time.process_time()
  # CPU seconds too: less sensitive than wall time to other work on a shared machine.
  return {"layers": cfg.model.num_layers, "scan_layers": cfg.model.scan_layers,
          "remat": cfg.train.remat, "impl": cfg.moe.expert_impl, "trace_lower_s": t1 - t0,
          "compile_s": t2 - t1, "compile_cpu_s": c2 - c1}


def compile_only(args) -> list[dict]:
  rows = []
  for scan in (False, True):
    over = [f"model.num_layers={args.compile_only_layers}", f"train.remat={args.remat}",
            f"model.scan_layers={scan}"]
    if args.smoke:
      cfg = load_config(None, SIZES["1b"] + SMOKE + over + args.overrides)
    else:
      cfg = load_config(REPO / "configs/mixtral_8x7b.yaml", over + args.overrides)
    r = compile_time(cfg)
    rows.append(r)
    print(json.dumps(r), flush=True)
  print(f"\n{jax.devices()[0].device_kind}; jax {jax.__version__}; "
        f"{'smoke' if args.smoke else 'Mixtral-8x7B'} shape, {args.compile_only_layers} layers")
  print("| scan_layers | remat | impl | trace + lower s | compile s | compile CPU s |")
  print("|---|---|---|---:|---:|---:|")
  for r in rows:
    print(f"| {r['scan_layers']} | {r['remat']} | {r['impl']} | {r['trace_lower_s']:.1f} | "
          f"{r['compile_s']:.1f} | {r['compile_cpu_s']:.1f} |")
  return rows


def main():
  p = argparse.ArgumentParser()
  p.add_argument("overrides", nargs="*", help="key=value config overrides, applied last")
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--impls", nargs="+", default=["gmm", "dense", "ragged"])
  p.add_argument("--size", default="1b", choices=sorted(SIZES))
  p.add_argument("--remat", default="none", choices=REMATS)
  p.add_argument("--scan-layers", action="store_true", help="model.scan_layers=true")
  p.add_argument("--compile-only-layers", type=int, default=0, metavar="N",
                 help="only compile the N-layer Mixtral-shape step, scan_layers false and true")
  p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
  args = p.parse_args()
  # key=value after --impls lands in it (nargs="+" is greedy): they are overrides.
  args.overrides += [a for a in args.impls if "=" in a]
  args.impls = [a for a in args.impls if "=" not in a]
  out = os.environ.get("OUT", ".")
  if args.compile_only_layers:
    rows = compile_only(args)
    with open(os.path.join(out, "bench_train_step_compile.json"), "w") as f:
      json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": rows}, f,
                indent=2)
    return
  extra = (SMOKE if args.smoke else []) + [f"train.remat={args.remat}",
                                           f"model.scan_layers={args.scan_layers}"]
  peak = matmul_tflops(1024 if args.smoke else 8192)
  rows = []
  for impl in args.impls:
    try:
      r = time_impl(train_config(args.size, impl, extra + args.overrides), args.steps)
      r["tflops"] = r["step_flops"] / r["step_ms"] / 1e9
      r["mfu"] = r["tflops"] / peak
    except Exception as err:  # record and go on: one impl must not hide the others
      r = {"impl": impl, "error": f"{type(err).__name__}: {err}"[:300]}
    rows.append(r)
    print(json.dumps(r), flush=True)
  with open(os.path.join(out, "bench_train_step.json"), "w") as f:
    json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__, "size": args.size,
               "bf16_matmul_tflops": peak, "rows": rows}, f, indent=2)
  print(f"\nbf16 matmul ceiling: {peak:.0f} TFLOP/s; device {jax.devices()[0].device_kind}; "
        f"jax {jax.__version__}; size {args.size}, remat {args.remat}, "
        f"scan_layers {args.scan_layers}")
  print("| impl | params | active | tokens/step | compile s | step ms | TFLOP/s | MFU | peak GiB |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    if "error" in r:
      print(f"| {r['impl']} | error: {r['error'][:80]} |")
    else:
      gb = f"{r['peak_gb']:.1f}" if r["peak_gb"] else "-"
      print(f"| {r['impl']} | {r['params'] / 1e9:.2f}B | {r['active_params'] / 1e9:.2f}B | "
            f"{r['tokens']} | {r['compile_s']:.1f} | {r['step_ms']:.1f} | {r['tflops']:.0f} | "
            f"{100 * r['mfu']:.1f}% | {gb} |")


if __name__ == "__main__":
  main()
