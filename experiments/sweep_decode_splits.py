"""Split count / warps sweep for the quantized decode-attention kernel at B=8, 32k (GQA 32/8,
D=128, 2-bit + 2% outliers), against bf16 XLA attention in the same run.

Hypothesis under test: the kernel is bound by the latency of its serial slot loop (~6 us per
16-token iteration per program, docs/benchmarks.md), so more programs per (sequence, head)
with fewer iterations each should cut time until the SMs are full.

GPU machine:  PYTHONPATH=. python3 experiments/sweep_decode_splits.py
"""
from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode_attention import (HQ, D, copy_bandwidth, make_kv, rel_err, timeit,  # noqa: E402
                                    xla_attention)
from pallas_kernels import kv_quant as kq  # noqa: E402
from pallas_kernels.decode_attention import decode_attention  # noqa: E402


def main():
  B, T = 8, 32768
  bw, _, _ = copy_bandwidth()
  sets = []
  for i in range(4):
    k, v = make_kv(jax.random.key(i), B, T)
    q = jax.random.normal(jax.random.key(100 + i), (B, HQ, D), jnp.bfloat16)
    L = jnp.full((B,), T, jnp.int32)
    kv = jax.jit(lambda k, v, L: kq.quantize_kv(k, v, kq.KVQuantConfig(bits=2, outlier_fraction=0.02),
                                                lengths=L))(k, v, L)
    sets.append((q, k, v, L, kv))
  xla = jax.jit(xla_attention)
  t_xla = timeit(xla, [(q, k, v, L) for q, k, v, L, _ in sets])
  kv0 = sets[0][4]
  kd, vd, _ = kv0.dequantize(jnp.float32)
  want = xla_attention(sets[0][0].astype(jnp.float32), kd, vd, sets[0][3])
  rows = [{"method": "xla_bf16", "ms": 1e3 * t_xla}]
  print(f"copy {bw / 1e12:.2f} TB/s; xla bf16 {1e3 * t_xla:.3f} ms; cache {kv0.nbytes / 1e6:.1f} MB", flush=True)
  for ns in (None, 16, 32, 64, 128):
    for warps in (4, 2):
      fn = jax.jit(lambda q, kv, ns=ns, w=warps: decode_attention(q, kv, num_splits=ns, num_warps=w))
      try:
        err = rel_err(fn(sets[0][0], kv0), want)
        t = timeit(fn, [(q, kv) for q, _, _, _, kv in sets])
        r = {"method": f"quant ns={ns} warps={warps}", "ms": 1e3 * t, "rel_err": err,
             "TB/s": kv0.nbytes / t / 1e12, "x_vs_xla": t_xla / t}
      except Exception as e:  # one variant failing must not hide the others
        r = {"method": f"quant ns={ns} warps={warps}", "error": str(e)[:200]}
      rows.append(r)
      print(json.dumps(r), flush=True)
  with open(os.path.join(os.environ.get("OUT", "."), "sweep_decode_splits.json"), "w") as f:
    json.dump({"copy_TBps": bw / 1e12, "jax": jax.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
  main()
