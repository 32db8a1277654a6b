"""Train-step time and MFU of a ~1B-parameter MoE with expert_impl gmm vs dense vs ragged.

Run on the GPU machine:  PYTHONPATH=. python3 experiments/bench_train_step.py
MFU = model FLOPs (6 x active params x tokens + attention) / step time / bf16 matmul rate
measured in the same run (8192^3 random bf16 matmul).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import load_config
from moejax.model.transformer import active_params
from moejax.state import init_state, make_train_step

SHAPE = ["model.vocab_size=32000", "model.d_model=2048", "model.num_layers=6",
         "model.num_heads=16", "model.num_kv_heads=8", "model.head_dim=128",
         "model.ffn_hidden=8192", "model.max_seq_len=2048", "model.tie_embeddings=false",
         "model.dtype=bfloat16", "model.param_dtype=float32", "moe.num_experts=8", "moe.top_k=2",
         "moe.expert_hidden=3072", "data.seq_len=2048", "data.batch_size=8",
         "data.tokenizer=bpe", "data.bpe_vocab_size=32000"]


def matmul_tflops(n=8192, reps=20):
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  f = jax.jit(lambda a, b: a @ b)
  f(a, b).block_until_ready()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    f(a, b).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2 * n ** 3 / np.median(times) / 1e12


def time_impl(impl: str, steps: int, extra: list[str]):
  cfg = load_config(None, SHAPE + [f"moe.expert_impl={impl}"] + extra)
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
  return {"impl": impl, "params": int(n_params), "active_params": active_params(cfg),
          "tokens": B * T, "compile_s": compile_s, "step_ms": 1e3 * float(np.median(times)),
          "step_flops": flops, "loss": float(m["loss"])}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--impls", nargs="+", default=["gmm", "dense", "ragged"])
  p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
  args = p.parse_args()
  extra = []
  if args.smoke:
    extra = ["model.d_model=64", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
             "model.head_dim=32", "model.ffn_hidden=128", "moe.expert_hidden=64",
             "model.vocab_size=512", "data.bpe_vocab_size=512", "data.seq_len=64",
             "data.batch_size=2", "model.max_seq_len=64"]
  peak = matmul_tflops(1024 if args.smoke else 8192)
  rows = []
  for impl in args.impls:
    # dense = capacity einsum: a dropless buffer would be tokens x tokens, so cf 1.25.
    e = extra + (["moe.capacity_factor=1.25"] if impl == "dense" else [])
    try:
      r = time_impl(impl, args.steps, e)
      r["tflops"] = r["step_flops"] / r["step_ms"] / 1e9
      r["mfu"] = r["tflops"] / peak
    except Exception as err:  # record and go on: one impl must not hide the others
      r = {"impl": impl, "error": f"{type(err).__name__}: {err}"[:300]}
    rows.append(r)
    print(json.dumps(r), flush=True)
  out = os.environ.get("OUT", ".")
  with open(os.path.join(out, "bench_train_step.json"), "w") as f:
    json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__,
               "bf16_matmul_tflops": peak, "rows": rows}, f, indent=2)
  print(f"\nbf16 matmul ceiling: {peak:.0f} TFLOP/s; device {jax.devices()[0].device_kind}; "
        f"jax {jax.__version__}")
  print("| impl | params | active | tokens/step | step ms | TFLOP/s | MFU |")
  print("|---|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    if "error" in r:
      print(f"| {r['impl']} | error: {r['error'][:80]} |")
    else:
      print(f"| {r['impl']} | {r['params'] / 1e9:.2f}B | {r['active_params'] / 1e9:.2f}B | "
            f"{r['tokens']} | {r['step_ms']:.1f} | {r['tflops']:.0f} | {100 * r['mfu']:.1f}% |")


if __name__ == "__main__":
  main()
