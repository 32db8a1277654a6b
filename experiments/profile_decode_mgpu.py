"""Where the Mosaic GPU decode kernel spends its time: ablations timed in one run.

Each variant leaves one stage out (wrong results, timing only): "out" the outlier
updates, "max" the running max (a cross-warp reduction per slot). With
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_TO=DIR the compiler's
resource report and SASS land in DIR.
Usage (device): PYTHONPATH=. python3 experiments/profile_decode_mgpu.py [B T splits...]
"""
import sys

import jax
import jax.numpy as jnp

from experiments.bench_decode_attention import make_kv, timeit, HQ, D
from pallas_kernels import decode_attention_mgpu as dm
from pallas_kernels import kv_quant as kq


def main():
  b, t = (int(x) for x in sys.argv[1:3]) if len(sys.argv) > 2 else (8, 32768)
  splits = [int(x) for x in sys.argv[3:]] or [None]
  k, v = make_kv(jax.random.key(0), b, t)
  q = jax.random.normal(jax.random.key(1), (b, HQ, D), jnp.bfloat16)
  cfg = kq.KVQuantConfig(bits=2, outlier_fraction=0.02)
  c = kq.quantize_kv(k, v, cfg)
  sets = [(q, c), (q, jax.tree.map(jnp.copy, c)), (q, jax.tree.map(jnp.copy, c))]
  for ns in splits:
    for ab in ((), ("out",), ("max",), ("out", "max")):
      f = jax.jit(lambda q, c, ab=frozenset(ab), ns=ns: dm.decode_attention_mgpu(
          q, c, sm_scale=D ** -0.5, num_splits=ns, ablate=ab))
      tm = timeit(f, sets)
      print(f"B={b} T={t} splits={ns} ablate={','.join(ab) or '-':22s} {tm * 1e3:8.3f} ms "
            f"{c.nbytes / tm / 1e12:5.2f} TB/s", flush=True)


if __name__ == "__main__":
  main()
