"""Where the Mosaic GPU decode kernel spends its time: variants and ablations timed in one run.

Each ablation leaves one stage out (wrong results, timing only): "out" the outlier
updates, "max" the running max (a cross-warp reduction per softmax update), "raw" the
dequantization (code words go to the MMAs as they are; "rawk" / "rawv" keys or values
only), "nometa" the metadata loads (constant scale and zero-point); "dblmma" issues every
MMA twice (their own cost).
``--phase`` lists slots per softmax update (64-token slots; 8 = one update per
512-token tile at 2 bits). With MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=DIR the
compiler's resource reports land in DIR (create DIR first: otherwise every dump goes to
stdout); ``--ptxas DIR`` prints their register and spill lines. ``--trace DIR`` runs one
call under Mosaic's on-device profiler and prints the time per kernel region.
Usage (device): PYTHONPATH=. python3 experiments/profile_decode_mgpu.py --b 8 --t 32768 \
  --phase 8 4 2 --ablate - out out,max
  PYTHONPATH=. python3 experiments/profile_decode_mgpu.py --check --triton --heads-pad 8 16
  PYTHONPATH=. python3 experiments/profile_decode_mgpu.py --check --split 0 1 --trace /tmp/tr
  (--stages 2 needs --split 0: two tiles in flight only through the whole-tile pipeline)
"""
import argparse
import collections
import glob
import itertools
import json
import os
import re

import jax
import jax.numpy as jnp

from experiments.bench_decode_attention import make_kv, timeit, HQ, D
from pallas_kernels import decode_attention_mgpu as dm
from pallas_kernels import kv_quant as kq
from pallas_kernels import reference
from pallas_kernels.decode_attention import decode_attention


def _warp_mma(flag: int):
  """--warpmma value -> the kernel's warp_mma (None: its own choice)."""
  return None if flag < 0 else bool(flag)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--b", type=int, default=8)
  ap.add_argument("--t", type=int, default=32768)
  ap.add_argument("--splits", type=int, nargs="*", default=[None])
  ap.add_argument("--phase", type=int, nargs="*", default=[None])
  ap.add_argument("--ablate", nargs="*", default=["-"])
  ap.add_argument("--inflight", type=int, nargs="*", default=[1])
  ap.add_argument("--stages", type=int, nargs="*", default=[dm.STAGES], help="TMA pipeline depths to try")
  ap.add_argument("--heads-pad", type=int, nargs="*", default=[0],
                  help="MMA N (query heads padded) to try; 0 = the kernel's choice")
  ap.add_argument("--omma", type=int, nargs="*", default=[1],
                  help="outliers_in_mma values to try (0: rank-1 updates, 1: MMA padding columns)")
  ap.add_argument("--split", type=int, nargs="*", default=[int(dm.SPLIT_FETCH)],
                  help="split_fetch values to try (1: next tile's keys and values fetched by hand, "
                       "each half as soon as its buffers are free)")
  ap.add_argument("--staged", type=int, nargs="*", default=[int(dm.STAGED_OUTLIERS)],
                  help="staged_outliers values to try (1: a tile's outliers converted to fp16 once, "
                       "0: per patched MMA register)")
  ap.add_argument("--inplace", type=int, nargs="*", default=[int(dm.IN_PLACE_CODES)],
                  help="in_place_codes values to try (1: slots read where a rotation left them, "
                       "three rotations per eight 2-bit slots instead of seven)")
  ap.add_argument("--loopdesc", type=int, nargs="*", default=[int(dm.LOOP_DESCRIPTORS)],
                  help="loop_descriptors values to try (1: MMA descriptors rebuilt in the loop)")
  ap.add_argument("--early", type=int, nargs="*", default=[int(dm.EARLY_FETCH)],
                  help="early_fetch values to try (1: a half's next tile fetched once its codes are "
                       "in registers, before its MMAs)")
  ap.add_argument("--warpmma", type=int, nargs="*", default=[-1],
                  help="warp_mma values to try (1: each warp its own tokens with mma.sync, 0: "
                       "wgmma, -1: the kernel's choice, warp_mma where the other options allow)")
  ap.add_argument("--merged", type=int, nargs="*", default=[int(dm.MERGED_BARRIERS)],
                  help="merged_barriers values to try (1: one barrier per half-tile under warp_mma)")
  ap.add_argument("--explicit", type=int, nargs="*", default=[int(dm.EXPLICIT_BARRIERS)],
                  help="explicit_barriers values to try (1: no barriers inserted by Pallas, warp_mma)")
  ap.add_argument("--outliers", type=float, default=0.02)
  ap.add_argument("--ptxas", default=None)
  ap.add_argument("--trace", default=None,
                  help="folder: one call with Mosaic's on-device profiler, then time per region")
  ap.add_argument("--check", action="store_true", help="first: error vs the reference (small, ragged)")
  ap.add_argument("--triton", action="store_true", help="also time the Triton kernel (both unit orders)")
  a = ap.parse_args()
  if a.check:
    kc, vc = make_kv(jax.random.key(2), 3, 1000)
    qc = jax.random.normal(jax.random.key(3), (3, HQ, D), jnp.bfloat16)
    for bits in (2, 4):
      cfg = kq.KVQuantConfig(bits=bits, outlier_fraction=a.outliers, residual_window=32, sink_tokens=4)
      cc = kq.quantize_kv(kc, vc, cfg, max_len=1024, lengths=jnp.array([1000, 517, 3]))
      ref = reference.quantized_decode_attention(qc, cc)
      for om, ph, sf, so, ip, ld, ef, wm, mb, xb in dict.fromkeys(itertools.product(   # once each
          a.omma, a.phase, a.split, a.staged, a.inplace, a.loopdesc,
          a.early, a.warpmma, a.merged, a.explicit)):
        try:
          out = dm.decode_attention_mgpu(qc, cc, sm_scale=D ** -0.5, outliers_in_mma=bool(om),
                                         stages=a.stages[0],
                                         phase_slots=ph, split_fetch=bool(sf), staged_outliers=bool(so),
                                         in_place_codes=bool(ip), loop_descriptors=bool(ld),
                                         early_fetch=bool(ef), warp_mma=_warp_mma(wm),
                                         merged_barriers=bool(mb), explicit_barriers=bool(xb))
        except Exception as e:            # errors may carry a whole module: keep both ends
          msg = str(e)
          print(f"check phase={ph}: {type(e).__name__}: {msg[:300]} ... {msg[-300:]}",
                flush=True)
          continue
        err = float(jnp.linalg.norm((out - ref).astype(jnp.float32))
                    / jnp.linalg.norm(ref.astype(jnp.float32)))
        print(f"check bits={bits} outliers_in_mma={om} phase={ph} split={sf} "
              f"staged={so} inplace={ip} loopdesc={ld} early={ef} warpmma={wm} merged={mb} explicit={xb}: "
              f"rel err {err:.2e}", flush=True)
  k, v = make_kv(jax.random.key(0), a.b, a.t)
  q = jax.random.normal(jax.random.key(1), (a.b, HQ, D), jnp.bfloat16)
  c = kq.quantize_kv(k, v, kq.KVQuantConfig(bits=2, outlier_fraction=a.outliers))
  sets = [(q, c), (q, jax.tree.map(jnp.copy, c)), (q, jax.tree.map(jnp.copy, c))]
  big_ref = None
  for ns in a.splits:
    for ph in a.phase:
      for fl in a.inflight:
        for om, st, hp, sf, so, ip, ld, ef, wm, mb, xb, ab in itertools.product(
            a.omma, a.stages, a.heads_pad, a.split, a.staged, a.inplace,
            a.loopdesc, a.early, a.warpmma, a.merged, a.explicit, a.ablate):
            ab = frozenset() if ab == "-" else frozenset(ab.split(","))
            f = jax.jit(lambda q, c, ab=ab, ns=ns, ph=ph, fl=fl, om=om, st=st, hp=hp, sf=sf, so=so, ip=ip, ld=ld, ef=ef, wm=wm, mb=mb, xb=xb:
                        dm.decode_attention_mgpu(
                            q, c, sm_scale=D ** -0.5, num_splits=ns, phase_slots=ph, inflight=fl,
                            outliers_in_mma=bool(om), stages=st, heads_pad=hp or None,
                            split_fetch=bool(sf),
                            staged_outliers=bool(so), in_place_codes=bool(ip),
                            loop_descriptors=bool(ld), early_fetch=bool(ef), ablate=ab,
                            warp_mma=_warp_mma(wm), merged_barriers=bool(mb),
                            explicit_barriers=bool(xb)))
            try:
              tm = timeit(f, sets)
            except Exception as e:        # e.g. a variant over the shared-memory limit
              print(f"phase={ph} stages={st}: {type(e).__name__}: {str(e)[:200]}", flush=True)
              continue
            err = ""
            if a.check and not ab:           # this size too
              big_ref = reference.quantized_decode_attention(q, c) if big_ref is None else big_ref
              out = f(q, c).astype(jnp.float32)
              err = f" rel err {float(jnp.linalg.norm(out - big_ref) / jnp.linalg.norm(big_ref)):.2e}"
            print(f"B={a.b} T={a.t} splits={ns} phase={ph} inflight={fl} omma={om} stages={st} heads_pad={hp} split={sf} staged={so} inplace={ip} loopdesc={ld} early={ef} wm={wm} mb={mb} xb={xb} "
                  f"ablate={','.join(sorted(ab)) or '-':10s} {tm * 1e3:8.3f} ms "
                  f"{c.nbytes / tm / 1e12:5.2f} TB/s{err}", flush=True)
  if a.trace:
    os.makedirs(a.trace, exist_ok=True)
    f = jax.jit(lambda q, c: dm.decode_attention_mgpu(q, c, sm_scale=D ** -0.5, profile_dir=a.trace,
                                                      split_fetch=bool(a.split[-1]),
                                                      staged_outliers=bool(a.staged[-1]),
                                                      in_place_codes=bool(a.inplace[-1]),
                                                      loop_descriptors=bool(a.loopdesc[-1]),
                                                      early_fetch=bool(a.early[-1]),
                                                      warp_mma=_warp_mma(a.warpmma[-1])))
    for _ in range(2):                # the second call's trace is read (the first one compiles)
      jax.block_until_ready(f(q, c))
    summarize_trace(max(glob.glob(f"{a.trace}/*trace.json"), key=os.path.getmtime))
  if a.triton:                      # both unit orders (rows_first: the L1-friendly one)
    for rf in (False, True):
      tm = timeit(jax.jit(lambda q, c, rf=rf: decode_attention(q, c, backend="triton", rows_first=rf)), sets)
      print(f"B={a.b} T={a.t} triton rows_first={rf} {tm * 1e3:8.3f} ms {c.nbytes / tm / 1e12:5.2f} TB/s",
            flush=True)
  if a.ptxas:
    for f in sorted(glob.glob(f"{a.ptxas}/*.ptxas"), key=lambda f: int(re.sub(r"\D", "", f.split("/")[-1]) or 0)):
      lines = [l.strip() for l in open(f) if re.search(r"registers|spill|smem", l)]
      print(f.split("/")[-1], " | ".join(lines))


def summarize_trace(path):
  """Per region: mean time per program (warp 0 of each warpgroup) and its share of the
  program's span (first region entered to last one left); the rest is time outside the
  regions (waiting for tiles, pipeline bookkeeping). Mosaic's trace adds SM clock cycles
  to a nanosecond start time and divides by 1e3: within a program the unit is 1000 cycles
  (about 0.5 us at the H200's 1.98 GHz); the kernel span mixes both."""
  events = json.load(open(path))["traceEvents"]
  per_prog, open_at, span = collections.defaultdict(lambda: collections.defaultdict(float)), {}, {}
  for e in events:
    key = (e["tid"], e["name"])
    if e["ph"] == "B":
      open_at[key] = e["ts"]
    else:
      per_prog[e["tid"]][e["name"]] += e["ts"] - open_at.pop(key)
    lo, hi = span.get(e["tid"], (e["ts"], e["ts"]))
    span[e["tid"]] = (min(lo, e["ts"]), max(hi, e["ts"]))
  n = len(per_prog)
  total = sum(hi - lo for lo, hi in span.values()) / n
  t0 = min(lo for lo, _ in span.values())
  t1 = max(hi for _, hi in span.values())
  print(f"trace {os.path.basename(path)}: {n} programs, kernel span ~{t1 - t0:.1f}, "
        f"mean program span {total:.2f} kcycles", flush=True)
  names = sorted({k for d in per_prog.values() for k in d})
  for name in names:
    mean = sum(d.get(name, 0.0) for d in per_prog.values()) / n
    print(f"  {name:8s} {mean:8.2f} kcycles per program  {100 * mean / total:5.1f} %", flush=True)
  inside = sum(sum(d.values()) for d in per_prog.values()) / n
  print(f"  {'(other)':8s} {total - inside:8.2f} kcycles per program  {100 * (total - inside) / total:5.1f} %")


if __name__ == "__main__":
  main()
