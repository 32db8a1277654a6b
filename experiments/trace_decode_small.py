"""Where a small decode-attention call spends its GPU time: every kernel of one call, from a
jax.profiler trace (device machine).
  PYTHONPATH=. python3 experiments/trace_decode_small.py --sizes 1x4096,8x4096,1x32768
Prints, per (size, method), the GPU kernel time per call by kind of kernel (numbered
fusions of one kind summed), the sum, and the wall time per call of 16 calls in one jitted
program; with $OUT set, also into $OUT/trace_decode_small.txt."""
import argparse
import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

import jax
import jax.numpy as jnp

from experiments.bench_decode_attention import HQ, D, make_kv, xla_attention
from pallas_kernels import decode_attention_mgpu as mgpu
from pallas_kernels import kv_quant as kq
from pallas_kernels.decode_attention import decode_attention

CALLS = 16


def kernel_times(fn, args, timeline=0):
  """{kernel name: mean us per call}, over CALLS calls in one jitted program. With
  ``timeline``, also prints that many GPU kernels of the last traced run (start offset, gap
  before, duration) and the host events that took longest per call (where the wall time
  beyond the GPU sum goes)."""
  run = jax.jit(lambda a: [fn(*x) for x in a])
  jax.block_until_ready(run(args))
  d = tempfile.mkdtemp()
  with jax.profiler.trace(d, create_perfetto_trace=True):
    for _ in range(3):
      jax.block_until_ready(run(args))
  path = glob.glob(f"{d}/**/*perfetto_trace.json.gz", recursive=True)
  if not path:
    print("no perfetto trace; files:", glob.glob(f"{d}/**/*", recursive=True)[:10])
    return {}
  ev = json.load(gzip.open(path[0]))
  ev = ev["traceEvents"] if isinstance(ev, dict) else ev
  pid_names = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
  gpu = [e for e in ev if e.get("ph") == "X" and "GPU" in pid_names.get(e["pid"], "")
         and "dur" in e and "Memcpy" not in e["name"]]
  if not gpu:
    print("no GPU kernel events; processes:", sorted(set(pid_names.values()))[:12])
  per = collections.defaultdict(float)
  for e in gpu:
    per[e["name"][:70]] += e["dur"] / (3 * CALLS)
  if timeline and gpu:
    gpu.sort(key=lambda e: e["ts"])
    last = gpu[-min(len(gpu), timeline):]
    t0, end = last[0]["ts"], last[0]["ts"]
    print(f"  timeline of the last {len(last)} GPU kernels (us: start, gap before, duration):")
    for e in last:
      print(f"    {e['ts'] - t0:9.1f} {e['ts'] - end:7.1f} {e['dur']:7.1f}  {e['name'][:60]}")
      end = e["ts"] + e["dur"]
    host = collections.defaultdict(float)
    for e in ev:
      if e.get("ph") == "X" and "dur" in e and "GPU" not in pid_names.get(e["pid"], ""):
        host[e["name"][:60]] += e["dur"] / (3 * CALLS)
    print("  host events, us per call (top 12):")
    for n, us in sorted(host.items(), key=lambda x: -x[1])[:12]:
      print(f"    {us:9.1f}  {n}")
  return dict(per)


def main():
  out_dir = os.environ.get("OUT")
  if out_dir:                       # tee everything printed into $OUT/trace_decode_small.txt
    import builtins
    log = open(os.path.join(out_dir, "trace_decode_small.txt"), "a")
    _print = builtins.print
    builtins.print = lambda *a, **k: (_print(*a, **k), _print(*a, file=log, flush=True))
  ap = argparse.ArgumentParser()
  ap.add_argument("--sizes", default="1x4096,8x4096,1x32768")
  ap.add_argument("--timeline", type=int, default=0, help="print this many kernels of one run")
  ap.add_argument("--methods", default="xla_bf16,triton,mosaic,mosaic_jnp_merge")
  ap.add_argument("--merge-variants", default="",
                  help="also time decode_merge_gpu's kernel alone on the Mosaic kernel's partials, "
                       "one variant per comma, each key=value pairs joined by /: dc (d_chunk; auto, 0 = one program per head), sps, unroll, warps, ablate (window+splits+gather), step (window_step), dot (window_dot); e.g. default,dc=64/sps=16,dot=split/step=32")
  a = ap.parse_args()
  cfg = kq.KVQuantConfig(bits=2, outlier_fraction=0.02)
  for s in a.sizes.split(","):
    b, t = (int(x) for x in s.split("x"))
    k, v = make_kv(jax.random.key(0), b, t)
    q = jax.random.normal(jax.random.key(1), (b, HQ, D), jnp.bfloat16)
    c = kq.quantize_kv(k, v, cfg)
    full = jnp.full((b,), t, jnp.int32)
    methods = {
        "xla_bf16": (jax.jit(xla_attention), [(q, jnp.copy(k), jnp.copy(v), full) for _ in range(CALLS)]),
        "triton": (jax.jit(lambda q, c: decode_attention(q, c, backend="triton")),
                   [(q, jax.tree.map(jnp.copy, c)) for _ in range(CALLS)]),
        "mosaic": (jax.jit(lambda q, c: decode_attention(q, c, backend="mosaic")),
                   [(q, jax.tree.map(jnp.copy, c)) for _ in range(CALLS)]),
        # the merge as XLA ops (decode_merge.merge_partials) instead of decode_merge_gpu's kernel
        "mosaic_jnp_merge": (jax.jit(lambda q, c: mgpu.decode_attention_mgpu(
            q, c, sm_scale=D ** -0.5, merge_kernel=False)),
            [(q, jax.tree.map(jnp.copy, c)) for _ in range(CALLS)]),
    }
    if a.merge_variants:
      from pallas_kernels.decode_merge import LOG2E, scaled_queries
      from pallas_kernels.decode_merge_gpu import merge_heads_minor
      qg = scaled_queries(q, c.num_heads, D ** -0.5)
      parts = mgpu.quantized_partials(qg, c, heads_minor=True)
      for var in a.merge_variants.split(","):
        kw = dict(x.split("=") for x in var.split("/") if "=" in x)   # e.g. dc=64/sps=16/dot=split
        conv = dict(dc=("d_chunk", lambda x: None if x == "auto" else int(x)),
                    sps=("splits_per_step", int), unroll=("unroll", lambda x: bool(int(x))),
                    warps=("num_warps", int), step=("window_step", int), dot=("window_dot", str),
                    ablate=("ablate", lambda x: frozenset(y for y in x.split("+") if y)))
        opts = {conv[k][0]: conv[k][1](x) for k, x in kw.items()}   # the rest: the kernel's defaults
        # as decode_attention_mgpu calls it: the raw query, scaled and cast back in the kernel
        fn = jax.jit(lambda qr, c, m, l, o, opts=opts: merge_heads_minor(
            qr, c, m, l, o, interpret=False, q_scale=D ** -0.5 * LOG2E, out_dtype=qr.dtype, **opts))
        qr = q.reshape(qg.shape)
        per = kernel_times(fn, [(qr, c) + tuple(jnp.copy(x) for x in parts) for _ in range(CALLS)])
        merge_us = sum(us for n, us in per.items() if "merge" in n)
        print(f"B={b} T={t} merge {var}: merge kernel {merge_us:.2f} us, "
              f"all kernels {sum(per.values()):.2f} us", flush=True)
    for name, (fn, args) in methods.items():
      if name not in a.methods.split(","):
        continue
      run = jax.jit(lambda a, fn=fn: [fn(*x) for x in a])
      try:
        jax.block_until_ready(run(args))
      except Exception as e:  # noqa: BLE001 (e.g. mosaic off Hopper)
        print(f"B={b} T={t} {name}: {type(e).__name__}: {str(e)[:200]}")
        continue
      t0 = time.perf_counter()
      for _ in range(20):
        out = run(args)
      jax.block_until_ready(out)
      wall = (time.perf_counter() - t0) / (20 * CALLS) * 1e6
      per = kernel_times(fn, args, a.timeline)
      tot = sum(per.values())
      print(f"B={b} T={t} {name}: {wall:.1f} us per call (wall), GPU kernels sum {tot:.1f} us, "
            f"{len(per)} kernels", flush=True)
      groups = collections.defaultdict(lambda: [0.0, 0])     # fusion kind -> [us, kernels]
      for n, us in per.items():
        kind = re.sub(r"(_\d+)+$", "", n)                  # sort_440_1 -> sort
        groups[kind][0] += us
        groups[kind][1] += 1
      for kind, (us, cnt) in sorted(groups.items(), key=lambda x: -x[1][0])[:14]:
        print(f"    {us:8.2f} us  {kind} ({cnt} kernels)", flush=True)


if __name__ == "__main__":
  main()
