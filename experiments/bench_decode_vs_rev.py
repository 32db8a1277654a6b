"""The Mosaic decode kernel of this tree against the same kernel at other git revisions,
timed alternately in one process on the same inputs: the check that a refactor or a
change leaves the default kernel's numerics and time as they were.

Prepare each baseline here (a copy of the revision's pallas_kernels, renamed so that both
import side by side), then carry the folder to the device machine:
  python3 experiments/bench_decode_vs_rev.py --prepare REV [--prepare REV2 ...]
      (writes .baseline/pallas_kernels_<rev>; add /.baseline/ to .git/info/exclude)
  PYTHONPATH=. python3 experiments/bench_decode_vs_rev.py [--sizes 8x32768,1x131072]
Reports per size: each revision's median ms (rounds alternate between revisions), the
ratio to the first baseline, whether outputs are bitwise equal to it, the relative error
against the float32 reference, and this tree's TB/s against a copy measured in the run.
"""
from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile

BASE_DIR = ".baseline"


def prepare(rev: str):
  """.baseline/pallas_kernels_<rev>: the revision's pallas_kernels with its imports renamed."""
  name = "pallas_kernels_" + re.sub(r"\W", "_", rev)
  dst = os.path.join(BASE_DIR, name)
  with tempfile.TemporaryDirectory() as tmp:
    archive = os.path.join(tmp, "pk.tar")
    subprocess.run(["git", "archive", "-o", archive, rev, "pallas_kernels"], check=True)
    with tarfile.open(archive) as tar:
      tar.extractall(tmp, filter="data")
    os.makedirs(BASE_DIR, exist_ok=True)
    subprocess.run(["rm", "-rf", dst], check=True)
    os.rename(os.path.join(tmp, "pallas_kernels"), dst)
  for path in glob.glob(os.path.join(dst, "**", "*.py"), recursive=True):
    text = open(path).read()
    open(path, "w").write(re.sub(r"\bpallas_kernels\b", name, text))
  print("wrote", dst)


def mosaic_call(pkg):
  """The package's decode attention, forced to the Mosaic GPU kernel (either API)."""
  if hasattr(pkg, "Unsupported"):           # implementation= (since the op-folder redesign)
    return lambda q, c: pkg.decode_attention(q, c, implementation="mosaic_gpu")
  return lambda q, c: pkg.decode_attention(q, c, backend="mosaic")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--prepare", action="append", default=[], metavar="REV")
  ap.add_argument("--sizes", default="8x32768,1x131072,8x4096")
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--out", default=os.environ.get("OUT", "runs/bench_decode_vs_rev"))
  a = ap.parse_args()
  if a.prepare:
    for rev in a.prepare:
      prepare(rev)
    return

  import jax
  import jax.numpy as jnp
  import numpy as np
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  sys.path.insert(0, BASE_DIR)
  import pallas_kernels
  from pallas_kernels.decode_attention import reference
  from bench_decode_attention import D, HKV, HQ, copy_bandwidth, make_kv, rel_err, timeit

  pkgs = {os.path.basename(p): importlib.import_module(os.path.basename(p))
          for p in sorted(glob.glob(os.path.join(BASE_DIR, "pallas_kernels_*")))}
  pkgs["this tree"] = pallas_kernels
  first = next(iter(pkgs))
  rate = copy_bandwidth()[0]
  info = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "copy_tbs": rate / 1e12}
  print(json.dumps(info), flush=True)
  rows = []
  for size in a.sizes.split(","):
    b, t = (int(x) for x in size.split("x"))
    nsets = max(2, min(8, (256 << 20) // (b * HKV * t * D // 2)))    # >= 256 MB of caches: no L2 reuse
    sets = {name: [] for name in pkgs}
    for i in range(nsets):
      k, v = make_kv(jax.random.key(10 + i), b, t)
      q = jax.random.normal(jax.random.key(100 + i), (b, HQ, D), jnp.bfloat16)
      lengths = jnp.full((b,), t, jnp.int32).at[0].set(t - 77)
      for name, pkg in pkgs.items():
        cfg = pkg.KVQuantConfig(bits=2, outlier_fraction=0.02)
        sets[name].append((q, pkg.quantize_kv(k, v, cfg, max_len=t, lengths=lengths)))
    outs = {name: jax.jit(mosaic_call(pkg))(*sets[name][0]) for name, pkg in pkgs.items()}
    ref = reference.quantized_decode_attention(*sets["this tree"][0])
    times = {name: [] for name in pkgs}
    for _ in range(a.rounds):                # alternate, so drifts of the card hit every revision
      for name, pkg in pkgs.items():
        times[name].append(timeit(mosaic_call(pkg), sets[name], target_s=0.05, reps=7))
    nbytes = sets["this tree"][0][1].nbytes + b * HQ * D * 2 * 2
    row = {"B": b, "S": t, "bytes": nbytes}
    for name in pkgs:
      med = float(np.median(times[name]))
      row[name] = dict(ms=med * 1e3, rounds_ms=[x * 1e3 for x in times[name]],
                       over_first=med / float(np.median(times[first])),
                       bitwise_first=bool((outs[name] == outs[first]).all()),
                       rel_err=rel_err(outs[name], ref))
    row["tbs"] = nbytes / (row["this tree"]["ms"] / 1e3) / 1e12
    row["pct_copy"] = 100 * row["tbs"] * 1e12 / rate
    rows.append(row)
    print(json.dumps(row), flush=True)
  os.makedirs(a.out, exist_ok=True)
  with open(os.path.join(a.out, "bench_decode_vs_rev.json"), "w") as f:
    json.dump({**info, "rows": rows}, f, indent=1)
  print(f"| B x S | {' | '.join(f'{n} ms' for n in pkgs)} | this / {first} | bitwise | rel err | TB/s | % copy |")
  for r in rows:
    print(f"| {r['B']} x {r['S']} | " + " | ".join(f"{r[n]['ms']:.4f}" for n in pkgs)
          + f" | {r['this tree']['over_first']:.3f} | {r['this tree']['bitwise_first']} | "
          f"{r['this tree']['rel_err']:.1e} | {r['tbs']:.2f} | {r['pct_copy']:.0f} |")


if __name__ == "__main__":
  main()
