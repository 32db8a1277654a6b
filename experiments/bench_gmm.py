"""Benchmark pallas_kernels.gmm against lax.ragged_dot, a dense per-expert einsum and tokamax.

One run: ceilings (device copy, bf16 matmul), a GPU correctness check, then the
issue-4 cases, forward and forward+backward:
  (a) Mixtral w1: K=4096, N=14336, E=8, 16384 rows balanced;
  (b) OLMoE: K=2048, N=1024, E=64, 32768 rows, balanced and skewed;
  (c) decode on the Mixtral shape: 1, 2, 16 tokens, top-2 of 8 (2, 4, 32 routed rows).
Prints a table last; writes JSON to $OUT (or --out).

  python experiments/bench_gmm.py            # on the GPU
  python experiments/bench_gmm.py --smoke    # tiny sizes, interpret mode, CPU
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import pallas_kernels as gmm_lib  # noqa: E402  (gmm_lib.gmm is the public function)
from pallas_kernels import (  # noqa: E402
    GmmTiling, dequantize_expert_weights, default_tiling, quantize_expert_weights)
from pallas_kernels.gmm import reference as ref  # noqa: E402
from pallas_kernels.gmm import triton as gmm_triton  # noqa: E402
from moejax.inference.timing import median_seconds  # noqa: E402


def tiling(bm, bk, bn, **kw):
  """A full Triton config: the fields not given take the values GmmTiling had as defaults
  (a GmmTiling field left None would be the heuristic's choice instead)."""
  fixed = dict(split_k=1, group_m=8, num_warps=4, num_stages=3, expert_major=False)
  return GmmTiling(bm, bk, bn, **{**fixed, **kw})


def dlhs_sweep(m, i, o, e):
  """Candidate tilings of the data gradient (gmm with a transposed rhs), default first."""
  return [default_tiling(m, i, o, e), tiling(128, 64, 128, num_warps=4, num_stages=4),
          tiling(128, 128, 128, num_warps=8, num_stages=3),
          tiling(128, 64, 256, num_warps=8, num_stages=4),
          tiling(128, 64, 256, num_warps=8, num_stages=3, group_m=16),
          tiling(256, 64, 128, num_warps=8, num_stages=3),
          tiling(128, 128, 256, num_warps=8, num_stages=2),
          tiling(128, 64, 256, num_warps=8, num_stages=3, group_m=4)]


def tgmm_sweep(m, i, o, e):
  """Candidate tilings of the weight gradient (tgmm), default first."""
  return [default_tiling(m, i, o, e, op="tgmm"), tiling(64, 128, 256, num_warps=8, num_stages=4),
          tiling(128, 128, 128, num_warps=8, num_stages=3),
          tiling(64, 256, 128, num_warps=8, num_stages=3),
          tiling(32, 128, 128, num_warps=4, num_stages=4),
          tiling(64, 128, 256, num_warps=8, num_stages=3, group_m=16),
          tiling(128, 256, 128, num_warps=8, num_stages=2),
          tiling(128, 128, 256, num_warps=8, num_stages=2)]


def import_tokamax():
  """tokamax 0.0.17 imports xprof for its own benchmark helpers only: stub it if absent."""
  try:
    import xprof  # noqa: F401
  except ImportError:
    d = tempfile.mkdtemp()
    os.makedirs(os.path.join(d, "xprof", "cli"))
    for f in ("xprof/__init__.py", "xprof/cli/__init__.py"):
      open(os.path.join(d, f), "w").close()
    with open(os.path.join(d, "xprof", "cli", "tools.py"), "w") as fh:
      fh.write("def get_kernel_stats_tool(*a, **k):\n  raise NotImplementedError('xprof stub')\n")
    sys.path.append(d)
  try:
    import tokamax
    return tokamax
  except Exception as e:  # noqa: BLE001
    print(f"tokamax unavailable: {type(e).__name__}: {e}")
    return None


def block(x):
  return jax.block_until_ready(x)


def time_fn(f, args, *, reps: int, min_rep_s: float = 0.02):
  """Median seconds per call: back-to-back calls, one sync per rep (GPU stays busy)."""
  return median_seconds(f, args, reps=reps, min_rep_s=min_rep_s)


def copy_ceiling(nbytes: int, reps: int):
  """Device copy bandwidth (bytes read + written), best of two ways of amortizing dispatch:
  a loop of barrier-separated x+1 inside one jit, and back-to-back jitted x+1 calls."""
  n = nbytes // 4
  x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
  loops = 20

  @jax.jit
  def looped(x):
    return jax.lax.fori_loop(0, loops, lambda i, y: jax.lax.optimization_barrier(y + 1), x)

  t_loop = time_fn(looped, (x,), reps=reps) / loops
  t_b2b = time_fn(jax.jit(lambda x: x + 1), (x,), reps=reps)
  return {"loop": 2 * nbytes / t_loop, "back_to_back": 2 * nbytes / t_b2b}


def matmul_ceiling(size: int, reps: int):
  ka, kb = jax.random.split(jax.random.key(1))
  a = jax.random.normal(ka, (size, size), jnp.bfloat16)
  b = jax.random.normal(kb, (size, size), jnp.bfloat16)
  t = time_fn(jax.jit(lambda a, b: a @ b), (a, b), reps=reps)
  return 2 * size**3 / t


def rel_err(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# --- implementations: f(x, w, gs) -> out, all on the same inputs --------------


def impls(tokamax, interpret, config=None):
  out = {
      "gmm": lambda x, w, gs: gmm_lib.gmm(x, w, gs, config=config, interpret=interpret),
      "ragged_dot": lambda x, w, gs: jax.lax.ragged_dot(x, w, gs),
  }
  if tokamax is not None:
    out["tokamax"] = lambda x, w, gs: tokamax.ragged_dot(x, w, gs, implementation="mosaic")
  return out


def dense_einsum(e):
  def f(x, w, gs):
    del gs  # balanced groups only
    m, k = x.shape
    return jnp.einsum("egk,ekn->egn", x.reshape(e, m // e, k), w).reshape(m, -1)
  return f


def fwd_bwd(f):
  """Forward output and both gradients (returning the output keeps the forward alive)."""
  def g(x, w, gs, dy):
    out, vjp = jax.vjp(lambda x, w: f(x, w, gs), x, w)
    return (out,) + vjp(dy)
  return g


def make_inputs(key, m, k, n, e, sizes, dtype=jnp.bfloat16):
  kx, kw, kd = jax.random.split(key, 3)
  x = jax.random.normal(kx, (m, k), dtype)
  w = (jax.random.normal(kw, (e, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
  dy = jax.random.normal(kd, (m, n), dtype)
  return x, w, jnp.asarray(sizes, jnp.int32), dy


def decode_sizes(rng, tokens, e, top_k=2):
  sizes = np.zeros(e, np.int64)
  for _ in range(tokens):
    sizes[rng.choice(e, top_k, replace=False)] += 1
  return sizes


def skewed_sizes(rng, m, e):
  p = rng.dirichlet(np.full(e, 0.3))
  sizes = np.floor(p * m).astype(np.int64)
  sizes[np.argmax(sizes)] += m - sizes.sum()
  return sizes


def check_gpu(interpret, results, shapes):
  """Our gmm / grads vs the plain reference on small random shapes (zeros, tails)."""
  rng = np.random.default_rng(123)
  for (m, k, n, e) in shapes:
    sizes = rng.integers(0, max(2, 2 * m // e), e)
    sizes[rng.integers(e)] = 0
    sizes = np.minimum(sizes, m)
    while sizes.sum() > m - 3:
      sizes[np.argmax(sizes)] -= 1
    x, w, gs, dy = make_inputs(jax.random.key(int(rng.integers(1 << 30))), m, k, n, e, sizes)
    out = gmm_lib.gmm(x, w, gs, preferred_element_type=jnp.float32, interpret=interpret)
    r = ref.gmm(x, w, gs, preferred_element_type=jnp.float32)
    tail_zero = bool(jnp.all(out[int(sizes.sum()):] == 0))
    _, dx, dw = fwd_bwd(lambda x, w, gs: gmm_lib.gmm(x, w, gs, interpret=interpret))(x, w, gs, dy)
    _, rdx, rdw = fwd_bwd(lambda x, w, gs: ref.gmm(x, w, gs))(x, w, gs, dy)
    qerrs = {}
    for bits, gsz in ((8, None), (4, None), (4, 64 if k % 128 == 0 else None)):
      q = quantize_expert_weights(w, bits=bits, group_size=gsz)
      oq = gmm_lib.gmm(x, q, gs, preferred_element_type=jnp.float32, interpret=interpret)
      rq = ref.gmm(x, dequantize_expert_weights(q, jnp.bfloat16), gs, jnp.float32)
      qerrs[f"int{bits}_g{gsz}"] = rel_err(oq, rq)
    row = dict(shape=(m, k, n, e), fwd=rel_err(out, r), dlhs=rel_err(dx, rdx),
               drhs=rel_err(dw, rdw), tail_zero=tail_zero, **qerrs)
    ok = row["fwd"] < 1e-2 and row["dlhs"] < 2e-2 and row["drhs"] < 2e-2 and tail_zero and all(
        v < 2e-2 for v in qerrs.values())
    row["ok"] = ok
    results["checks"].append(row)
    print("check", row, flush=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--smoke", action="store_true", help="tiny sizes in interpret mode (CPU)")
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
  ap.add_argument("--cases", default="ceil,check,a,b,c")
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--no-bwd", action="store_true")
  ap.add_argument("--sweep", action="store_true", help="also time candidate tilings")
  args = ap.parse_args()
  cases = set(args.cases.split(","))
  interpret = True if args.smoke else None
  tokamax = None if args.smoke else import_tokamax()
  reps = 1 if args.smoke else args.reps
  dev = jax.devices()[0]
  results = dict(date=time.strftime("%Y-%m-%d"), device=str(getattr(dev, "device_kind", dev)),
                 jax=jax.__version__, argv=sys.argv, rows=[], checks=[], ceilings={})
  print(f"device={results['device']} jax={jax.__version__}", flush=True)
  if args.smoke:
    sz = dict(a=(64, 32, 64, 8), b=(256, 32, 32, 64), c=(None, 64, 128, 8))
  else:
    sz = dict(a=(16384, 4096, 14336, 8), b=(32768, 2048, 1024, 64), c=(None, 4096, 14336, 8))

  if "ceil" in cases:
    cb = copy_ceiling(1 << 20 if args.smoke else 4 << 30, reps)
    mm = matmul_ceiling(256 if args.smoke else 8192, reps)
    results["ceilings"] = dict(copy_TBps=max(cb.values()) / 1e12, matmul_TFLOPs=mm / 1e12,
                               **{f"copy_{k}_TBps": v / 1e12 for k, v in cb.items()})
    print("ceilings", results["ceilings"], flush=True)
  copy_bw = results["ceilings"].get("copy_TBps", float("nan")) * 1e12

  if "check" in cases:
    shapes = [(37, 64, 48, 4), (200, 128, 256, 8), (300, 256, 128, 64), (5, 256, 512, 8)]
    if args.smoke:
      shapes = shapes[:1]
    check_gpu(interpret, results, shapes)

  def record(case, pas, impl, t, flops, nbytes, extra=None):
    row = dict(case=case, pass_=pas, impl=impl, ms=t * 1e3, TFLOPs=flops / t / 1e12,
               TBps=nbytes / t / 1e12, **(extra or {}))
    results["rows"].append(row)
    print("row", row, flush=True)
    os.makedirs(args.out, exist_ok=True)  # partial results survive a timeout
    with open(os.path.join(args.out, "bench_gmm.json"), "w") as fh:
      json.dump(results, fh, indent=1, default=str)

  def run_case(case, x, w, gs, dy, *, dense, sweep_tilings=(), routed_bytes=None):
    m, k = x.shape
    e, _, n = w.shape
    flops = 2.0 * float(np.asarray(gs).sum()) * k * n
    nbytes = routed_bytes if routed_bytes is not None else (x.nbytes + w.nbytes + m * n * 2)
    extra = dict(m=m, k=k, n=n, e=e)
    fs = impls(tokamax, interpret)
    if dense:
      fs["dense_einsum"] = dense_einsum(e)
    for tl in sweep_tilings:
      tl = tl.resolve(m, k, n, e)  # fields left None: the heuristic's, shown in the label
      fs[f"gmm[{tl.bm},{tl.bk},{tl.bn},s{tl.split_k},w{tl.num_warps},st{tl.num_stages}"
         f"{',g' + str(tl.group_m) if tl.group_m != 8 else ''}{',em' if tl.expert_major else ''}]"] = (
          lambda x, w, gs, tl=tl: gmm_lib.gmm(x, w, gs, config=tl, interpret=interpret))
    total = int(np.asarray(gs).sum())
    want = jax.jit(lambda x, w, gs: jax.lax.ragged_dot(
        x, w, gs, preferred_element_type=jnp.float32))(x, w, gs)[:total]
    for name, f in fs.items():
      try:
        jf = jax.jit(f)
        out = block(jf(x, w, gs))
        err = rel_err(out.astype(jnp.float32)[:total], want)
        t = time_fn(jf, (x, w, gs), reps=reps)
        ex = dict(extra, err_vs_ragged_dot=err)
        if routed_bytes is not None and copy_bw == copy_bw:
          ex["frac_copy_bw"] = routed_bytes / t / copy_bw
        record(case, "fwd", name, t, flops, nbytes, ex)
      except Exception as exc:  # noqa: BLE001
        traceback.print_exc(limit=2)
        results["rows"].append(dict(case=case, pass_="fwd", impl=name, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
      if args.no_bwd or name.startswith("gmm["):
        continue
      try:
        jg = jax.jit(fwd_bwd(f))
        t = time_fn(jg, (x, w, gs, dy), reps=reps)
        record(case, "fwd+bwd", name, t, 3 * flops, 3 * nbytes, extra)
      except Exception as exc:  # noqa: BLE001
        traceback.print_exc(limit=2)
        results["rows"].append(dict(case=case, pass_="fwd+bwd", impl=name, error=f"{type(exc).__name__}: {str(exc)[:300]}"))

  def bwd_parts(case, x, w, gs, dy, dlhs_tilings, tgmm_tilings):
    """The two backward kernels alone, for a few tilings each."""
    m, k = x.shape
    e, _, n = w.shape
    flops = 2.0 * float(np.asarray(gs).sum()) * k * n
    for tl in dlhs_tilings:
      f = jax.jit(lambda dy, w, gs, tl=tl: gmm_triton.gmm(
          dy, w, gs, o=k, config=tl, transpose_rhs=True, out_dtype=x.dtype,
          interpret=bool(interpret)))
      t = time_fn(f, (dy, w, gs), reps=reps)
      record(case, "dlhs", f"gmm_T[{tl.bm},{tl.bk},{tl.bn},w{tl.num_warps},st{tl.num_stages},"
             f"g{tl.group_m}]",
             t, flops, 0.0)
    for tl in tgmm_tilings:
      f = jax.jit(lambda x, dy, gs, tl=tl: gmm_triton.tgmm(
          x, dy, gs, config=tl, lhs_im=False, out_dtype=w.dtype, interpret=bool(interpret)))
      t = time_fn(f, (x, dy, gs), reps=reps)
      record(case, "drhs", f"tgmm[{tl.bm},{tl.bk},{tl.bn},w{tl.num_warps},st{tl.num_stages},"
             f"g{tl.group_m}]",
             t, flops, 0.0)

  def quant_decode(case, x, w, gs, sizes, sweep_tilings=()):
    """Weight-only int8 / int4 experts at decode (per output channel and 128-row scale
    groups): bytes are the routed experts' codes + scales."""
    total = int(sizes.sum())
    g = 128 if w.shape[1] >= 512 else 16
    for bits, group in ((8, None), (8, g), (4, None), (4, g)):
      q = quantize_expert_weights(w, bits=bits, group_size=group)
      want = jax.lax.ragged_dot(x, dequantize_expert_weights(q, x.dtype), gs,
                                preferred_element_type=jnp.float32)[:total]
      routed = int((sizes > 0).sum()) * q.nbytes // w.shape[0]
      flops = 2.0 * total * w.shape[1] * w.shape[2]
      label = f"gmm_int{bits}" + ("" if group is None else f"_g{group}")
      for tl in (None,) + tuple(sweep_tilings):
        name = label if tl is None else label + (
            f"[{tl.bk},{tl.bn},s{tl.split_k},w{tl.num_warps},st{tl.num_stages}]")
        try:
          f = jax.jit(lambda x, q, gs, tl=tl: gmm_lib.gmm(x, q, gs, config=tl,
                                                          interpret=interpret))
          err = rel_err(block(f(x, q, gs)).astype(jnp.float32)[:total], want)
          t = time_fn(f, (x, q, gs), reps=reps)
          ex = dict(err_vs_dequant=err)
          if copy_bw == copy_bw:
            ex["frac_copy_bw"] = routed / t / copy_bw
          record(case, "fwd", name, t, flops, routed, ex)
        except Exception as exc:  # noqa: BLE001
          traceback.print_exc(limit=2)
          results["rows"].append(dict(case=case, pass_="fwd", impl=name,
                                      error=f"{type(exc).__name__}: {str(exc)[:300]}"))

  rng = np.random.default_rng(0)
  key = jax.random.key(42)
  if "a" in cases:
    m, k, n, e = sz["a"]
    x, w, gs, dy = make_inputs(key, m, k, n, e, [m // e] * e)
    sweep = [tiling(128, 64, 256, num_warps=8, num_stages=4),
             tiling(128, 64, 256, num_warps=8, num_stages=3, group_m=16)] if args.sweep else []
    run_case("a_mixtral_16k", x, w, gs, dy, dense=True, sweep_tilings=sweep)
    if args.sweep:
      bwd_parts("a_mixtral_16k", x, w, gs, dy,
                dlhs_sweep(m, n, k, e), tgmm_sweep(m, k, n, e))
    del x, w, dy
  if "b" in cases:
    m, k, n, e = sz["b"]
    for label, sizes in (("balanced", [m // e] * e), ("skewed", skewed_sizes(rng, m, e))):
      x, w, gs, dy = make_inputs(key, m, k, n, e, sizes)
      sweep = [tiling(128, 64, 256, num_warps=8, num_stages=3),
               tiling(128, 128, 128, num_warps=8, num_stages=3)] if args.sweep else []
      run_case(f"b_olmoe_{label}", x, w, gs, dy, dense=label == "balanced", sweep_tilings=sweep)
      if args.sweep and label == "balanced":
        bwd_parts(f"b_olmoe_{label}", x, w, gs, dy,
                  dlhs_sweep(m, n, k, e), tgmm_sweep(m, k, n, e))
      del x, w, dy
  if "c" in cases:
    _, k, n, e = sz["c"]
    for tokens in (1, 2, 16):
      sizes = decode_sizes(rng, tokens, e)
      m = int(sizes.sum())
      x, w, gs, dy = make_inputs(key, m, k, n, e, sizes)
      routed = int((sizes > 0).sum()) * k * n * 2
      base = default_tiling(m, k, n, e)
      sweep = [dataclasses.replace(base, expert_major=False),
               dataclasses.replace(base, bk=256, split_k=max(1, base.split_k // 2),
                                   num_stages=3),
               dataclasses.replace(base, bn=64, num_stages=6),
               ] if args.sweep else []
      case = f"c_decode_{tokens}tok_{m}rows_{int((sizes > 0).sum())}exp"
      run_case(case, x, w, gs, dy, dense=False, sweep_tilings=sweep, routed_bytes=routed)
      qsweep = [dataclasses.replace(base, bk=bk, bn=bn, split_k=sk, num_warps=nw,
                                    num_stages=st)
                for bk, bn, sk, nw, st in ((128, 128, 1, 4, 4), (128, 128, 2, 4, 4),
                                           (128, 128, 4, 4, 4), (256, 64, 2, 4, 3),
                                           (64, 256, 4, 4, 4), (128, 256, 2, 8, 3),
                                           (256, 128, 1, 8, 3), (64, 128, 8, 4, 6))
                ] if args.sweep else []
      quant_decode(case, x, w, gs, sizes, qsweep)

  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "bench_gmm.json")
  with open(path, "w") as fh:
    json.dump(results, fh, indent=1, default=str)
  print(f"\nwrote {path}")
  print(f"ceilings: {results['ceilings']}")
  print(f"checks ok: {[c['ok'] for c in results['checks']]}")
  print(f"{'case':34s} {'pass':8s} {'impl':34s} {'ms':>9s} {'TFLOP/s':>8s} {'TB/s':>6s} {'x_rd':>6s} {'x_tok':>6s}")
  base = {(r["case"], r["pass_"], r["impl"]): r.get("ms") for r in results["rows"]}
  for r in results["rows"]:
    if "error" in r:
      print(f"{r['case']:34s} {r['pass_']:8s} {r['impl']:34s} ERROR {r['error'][:60]}")
      continue
    rd = base.get((r["case"], r["pass_"], "ragged_dot"))
    tk = base.get((r["case"], r["pass_"], "tokamax"))
    print(f"{r['case']:34s} {r['pass_']:8s} {r['impl']:34s} {r['ms']:9.4f} {r['TFLOPs']:8.1f} "
          f"{r['TBps']:6.2f} {(rd or float('nan')) / r['ms']:6.2f} {(tk or float('nan')) / r['ms']:6.2f}"
          + (f"  {100 * r['frac_copy_bw']:.0f}%copy" if "frac_copy_bw" in r else ""))


if __name__ == "__main__":
  main()
