"""Decode attention on a packed, quantized KV cache vs bf16 peers, timed in one run.

Usage (device machine, from the repo root):
  PYTHONPATH=. python3 experiments/bench_decode_attention.py [--out DIR] [--quick] [--sizes 8x32768,...]
      [--triton-config '{"num_warps": 2}'] [--mosaic-config '{"num_splits": 4}']

Times, at B in {1, 8}, context in {4k, 32k, 128k}, GQA 32 query / 8 kv heads, D = 128:
  xla_bf16     plain jnp/XLA attention on a bf16 cache [B, H, T, D]
  pallas_gqa   jax.experimental.pallas.ops.gpu.decode_attention.gqa (bf16, [B, T, H, D])
  ours_bf16    pallas_kernels.decode_attention_bf16(implementation="triton")
  ours_2b2     pallas_kernels.decode_attention(implementation="triton"), 2-bit + 2% outlier channels
  ours_seed    the same, 2-bit + 15% outlier channels (seed config)
  mosaic_2b2   pallas_kernels.decode_attention(implementation="mosaic_gpu") (Hopper), 2-bit + 2%
(--triton-config / --mosaic-config: TritonConfig / MosaicGpuConfig fields as JSON, for the
quantized Triton / Mosaic rows) and a device copy (ceiling), measured in the same run.
Each figure is, after a warm-up, the median over repetitions of the mean time of many
back-to-back calls, rotating over enough input copies that no call reads from L2; the
calls on all copies form one jitted program, so host dispatch is paid once per program
(see timeit; --dispatch-per-call for the old way). Bytes read = the cache bytes the
method must read (bf16: K+V; quantized: every array of the cache). Output: a table on
stdout and OUT/bench_decode_attention.json.
Correctness: every kernel is first compared with the float32 reference on
ragged lengths.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import decode_attention, decode_attention_bf16
from pallas_kernels.decode_attention import MosaicGpuConfig, TritonConfig, reference
from pallas_kernels.kv import packing
from pallas_kernels.kv import quant as kq

HQ, HKV, D = 32, 8, 128
METHODS = ("xla_bf16", "pallas_gqa", "ours_bf16", "ours_2b2", "ours_seed", "mosaic_2b2")

DISPATCH_PER_CALL = False


def log(*a):
  print(*a, flush=True)


def timeit(fn, arg_sets, target_s=0.03, reps=5):
  """Per-call time: median over reps of (time of n back-to-back runs) / (n * calls per run).

  By default one run is a single jitted program that calls ``fn`` once on each input set in
  turn (as a model step calls attention once per layer), so host dispatch, which costs more
  than a small kernel for a cache pytree of ~15 arrays, is paid once per len(arg_sets)
  calls. With DISPATCH_PER_CALL (--dispatch-per-call, the method before 2026-12-03 session
  8) each call is its own dispatch, cycling over the sets."""
  if DISPATCH_PER_CALL:
    run, per_run, args_of = fn, 1, lambda i: arg_sets[i % len(arg_sets)]
  else:
    all_sets = jax.jit(lambda sets: [fn(*a) for a in sets])
    run, per_run, args_of = all_sets, len(arg_sets), lambda i: (arg_sets,)
  out = run(*args_of(0))
  jax.block_until_ready(out)
  t0 = time.perf_counter()
  for i in range(3):
    out = run(*args_of(i))
  jax.block_until_ready(out)
  est = (time.perf_counter() - t0) / 3
  n = int(min(400, max(10, math.ceil(target_s / max(est, 1e-6)))))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for i in range(n):
      out = run(*args_of(i))
    jax.block_until_ready(out)
    ts.append((time.perf_counter() - t0) / (n * per_run))
  return float(np.median(ts))


def copies(nbytes, make, budget=256 << 20, cap=32):
  k = int(min(cap, max(1, math.ceil(budget / max(nbytes, 1)))))
  return [make(i) for i in range(k)]


def copy_bandwidth(gib=2.0, f32_gib=4.0):
  """Device copy rate (bytes read + written) of a jitted ``x + 1``, back to back: the best of
  a ``gib`` GiB bf16 array and an ``f32_gib`` GiB f32 one (bf16 alone read ~3.35 TB/s on an
  H200, f32 4.19: the ceiling is the faster copy). Returns (rate, its time, {name: rate})."""
  rates, times = {}, {}
  for name, dtype, n_bytes in (("bf16", jnp.bfloat16, gib * (1 << 30)),
                               ("f32", jnp.float32, f32_gib * (1 << 30))):
    x = jax.random.normal(jax.random.key(0), (int(n_bytes) // jnp.dtype(dtype).itemsize,), dtype)
    times[name] = timeit(jax.jit(lambda x: x + 1), [(x,)], target_s=0.2)
    rates[name] = 2 * x.nbytes / times[name]
    del x
  best = max(rates, key=rates.get)
  return rates[best], times[best], rates


def xla_attention(q, k, v, lengths):
  """bf16 XLA decode attention: q [B, Hq, D], k/v [B, H, T, D]."""
  b, hq, d = q.shape
  h, t = k.shape[1], k.shape[2]
  qg = q.reshape(b, h, hq // h, d)
  s = jnp.einsum("bhgd,bhtd->bhgt", qg, k, preferred_element_type=jnp.float32) / math.sqrt(d)
  s = jnp.where((jnp.arange(t)[None, :] < lengths[:, None])[:, None, None, :], s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  o = jnp.einsum("bhgt,bhtd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return o.reshape(b, hq, d).astype(q.dtype)


def rel_err(a, b):
  a = np.asarray(a, np.float32)
  b = np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def make_kv(key, b, t):
  k1, k2, k3 = jax.random.split(key, 3)
  # keys with per-channel offsets and a few large channels (as real keys have)
  chan = jnp.exp(0.6 * jax.random.normal(k3, (1, HKV, 1, D)))
  k = (jax.random.normal(k1, (b, HKV, t, D)) * chan + 0.5 * chan).astype(jnp.bfloat16)
  v = jax.random.normal(k2, (b, HKV, t, D)).astype(jnp.bfloat16)
  return k, v


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", "runs/bench_decode_attention"))
  ap.add_argument("--quick", action="store_true", help="B=8, 32k only")
  ap.add_argument("--sizes", default=None, help="comma list of BxT, e.g. 8x32768,1x4096")
  ap.add_argument("--deadline", type=float, default=400.0, help="seconds; skip what would start later")
  ap.add_argument("--copy-gib", type=float, default=2.0)
  ap.add_argument("--dispatch-per-call", action="store_true",
                  help="one host dispatch per timed call (the method before session 8)")
  ap.add_argument("--triton-config", default="{}", help="TritonConfig fields as JSON (quantized rows)")
  ap.add_argument("--mosaic-config", default="{}", help="MosaicGpuConfig fields as JSON")
  args = ap.parse_args()
  triton_cfg = TritonConfig(**json.loads(args.triton_config))
  mosaic_cfg = MosaicGpuConfig(**json.loads(args.mosaic_config))
  global DISPATCH_PER_CALL
  DISPATCH_PER_CALL = args.dispatch_per_call
  os.makedirs(args.out, exist_ok=True)
  start = time.time()
  dev = jax.devices()[0]
  info = {"date": time.strftime("%Y-%m-%d"), "device": dev.device_kind, "jax": jax.__version__,
          "backend": jax.default_backend(), "triton_config": repr(triton_cfg),
          "mosaic_config": repr(mosaic_cfg)}
  log("env", info)

  bw, tcopy, rates = copy_bandwidth(args.copy_gib)
  info["copy_TBps"] = bw / 1e12
  info.update({f"copy_{k}_TBps": r / 1e12 for k, r in rates.items()})
  log(f"device copy: {bw / 1e12:.2f} TB/s (x+1, read+write, best of "
      + ", ".join(f"{k} {r / 1e12:.2f}" for k, r in rates.items()) + f"; {tcopy * 1e3:.3f} ms)")

  rng = np.random.default_rng(0)
  for bits in (2, 3, 4, 8):
    kw = dict(axis=1, stride=kq.PACK_STRIDE, word_bits=kq.WORD_BITS)   # the cache's layout
    p = packing.pack_block(bits, kq.PACK_STRIDE, kq.WORD_BITS)
    codes = jnp.asarray(rng.integers(0, 1 << bits, size=(8, 4 * p, 128)), jnp.uint8)
    try:
      w = packing.pack(codes, bits, **kw)
      ok = bool((w == packing.pack_jnp(codes, bits, **kw)).all()) and bool(
          (packing.unpack(w, bits, **kw) == codes).all())
    except Exception as e:  # noqa: BLE001
      ok = repr(e)[:300]
    info[f"pack_unpack_{bits}bit_ok"] = ok
    log(f"pack/unpack kernels {bits}-bit vs jnp: {ok}")

  try:
    from jax.experimental.pallas.ops.gpu import decode_attention as jax_da
    gqa = jax.jit(lambda q, k, v, L: jax_da.gqa(q, k, v, kv_seq_len=L))
  except Exception as e:  # noqa: BLE001
    log("pallas gqa unavailable:", repr(e))
    gqa = None

  two_bit = kq.KVQuantConfig(bits=2, outlier_fraction=0.02)
  configs = {"mosaic_2b2": two_bit, "ours_2b2": two_bit,
             "ours_seed": kq.KVQuantConfig(bits=2, outlier_fraction=0.15)}
  sizes = [(8, 32768), (1, 32768), (8, 131072), (1, 131072), (8, 4096), (1, 4096)]
  if args.quick:
    sizes = [(8, 32768)]
  if args.sizes:
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
  rows = []
  checks = {}
  xla_fn = jax.jit(xla_attention)
  ours_bf16 = jax.jit(lambda q, k, v, L: decode_attention_bf16(q, k, v, L, implementation="triton"))
  ours_q = jax.jit(lambda q, c: decode_attention(q, c, implementation="triton", config=triton_cfg))
  mosaic_q = jax.jit(lambda q, c: decode_attention(q, c, implementation="mosaic_gpu", config=mosaic_cfg))
  quantize = {cfg: jax.jit(lambda k, v, L, cfg=cfg: kq.quantize_kv(k, v, cfg, lengths=L))
              for cfg in configs.values()}                  # one compile per distinct config

  for (b, t) in sizes:
    if time.time() - start > args.deadline:
      log(f"deadline: skipping B={b} T={t}")
      continue
    key = jax.random.key(b * 1000003 + t)
    k, v = make_kv(key, b, t)
    q = jax.random.normal(jax.random.fold_in(key, 7), (b, HQ, D), jnp.bfloat16)
    full = jnp.full((b,), t, jnp.int32)
    ragged = jnp.asarray(np.random.default_rng(t + b).integers(t // 2, t + 1, size=b), jnp.int32).at[0].set(t)
    bf16_bytes = 2 * k.nbytes
    res = {"B": b, "T": t}

    # correctness on ragged lengths (same shapes as the timed calls)
    do_check = t <= 32768
    if do_check:
      ref = reference.decode_attention_bf16(q, k, v, ragged)
      checks[f"B{b}_T{t}_ours_bf16"] = rel_err(ours_bf16(q, k, v, ragged), ref)
      checks[f"B{b}_T{t}_xla_bf16"] = rel_err(xla_fn(q, k, v, ragged), ref)
      if gqa is not None:
        try:
          checks[f"B{b}_T{t}_pallas_gqa"] = rel_err(
              gqa(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), ragged), ref)
        except Exception as e:  # noqa: BLE001
          log("gqa failed:", repr(e)[:400])
          gqa = None

    def bf16_sets(i, k=k, v=v):
      return (q, k if i == 0 else jnp.copy(k), v if i == 0 else jnp.copy(v), full)
    sets = copies(bf16_bytes, bf16_sets)
    for name, fn, tr in (("xla_bf16", xla_fn, False), ("ours_bf16", ours_bf16, False),
                         ("pallas_gqa", gqa, True)):
      if fn is None:
        continue
      s2 = [(a[0], jnp.swapaxes(a[1], 1, 2), jnp.swapaxes(a[2], 1, 2), a[3]) for a in sets] if tr else sets
      try:
        tm = timeit(fn, s2)
        res[name] = {"ms": tm * 1e3, "bytes": bf16_bytes, "TBps": bf16_bytes / tm / 1e12}
        log(f"B={b} T={t} {name:10s} {tm * 1e3:8.3f} ms {bf16_bytes / tm / 1e12:6.2f} TB/s")
      except Exception as e:  # noqa: BLE001
        log(f"B={b} T={t} {name} failed: {repr(e)[:400]}")
      del s2
    del sets

    for name, cfg in configs.items():
      if time.time() - start > args.deadline:
        log(f"deadline: skipping {name} B={b} T={t}")
        continue
      try:
        tq = time.time()
        fn = mosaic_q if name.startswith("mosaic") else ours_q
        if do_check:
          cr = quantize[cfg](k, v, ragged)
          out = fn(q, cr)
          checks[f"B{b}_T{t}_{name}"] = rel_err(out, reference.quantized_decode_attention(q, cr))
          checks[f"B{b}_T{t}_{name}_vs_bf16"] = rel_err(out, reference.decode_attention_bf16(q, k, v, ragged))
          del cr
        c = quantize[cfg](k, v, full)
        nbytes = c.nbytes
        sets = copies(nbytes, lambda i: (q, c if i == 0 else jax.tree.map(jnp.copy, c)))
        tm = timeit(fn, sets)
        res[name] = {"ms": tm * 1e3, "bytes": nbytes, "TBps": nbytes / tm / 1e12,
                     "bits_per_element": c.bits_per_element, "setup_s": time.time() - tq}
        log(f"B={b} T={t} {name:10s} {tm * 1e3:8.3f} ms {nbytes / tm / 1e12:6.2f} TB/s "
            f"({c.bits_per_element:.2f} bits/elem, {time.time() - tq:.1f}s incl. compile)")
        del sets, c
      except Exception as e:  # noqa: BLE001
        log(f"B={b} T={t} {name} failed: {repr(e)[:1500]}")
    rows.append(res)
    with open(os.path.join(args.out, "bench_decode_attention.json"), "w") as f:
      json.dump({"info": info, "rows": rows, "checks": checks}, f, indent=1)

  log("\nchecks (relative L2 error vs float32 reference):")
  for kname, e in checks.items():
    log(f"  {kname:32s} {e:.2e}")
  log(f"\n{info}")
  log(f"{'B':>2} {'T':>7} | " + " | ".join(f"{m:>20s}" for m in METHODS))
  for r in rows:
    cells = []
    for m in METHODS:
      x = r.get(m)
      cells.append(f"{x['ms']:8.3f}ms {x['TBps']:5.2f}TB/s" if x else f"{'-':>20s}")
    log(f"{r['B']:>2} {r['T']:>7} | " + " | ".join(cells))
  # the target (B=8, 32k): >= 60 % of the copy on bytes read, >= 6x bf16 XLA
  for r in rows:
    for m in ("ours_2b2", "mosaic_2b2"):
      if m in r and "xla_bf16" in r:
        log(f"B={r['B']} T={r['T']} {m}: {100 * r[m]['TBps'] / info['copy_TBps']:.0f} % of copy "
            f"({info['copy_TBps']:.2f} TB/s), {r['xla_bf16']['ms'] / r[m]['ms']:.2f}x xla_bf16")
  log(f"total {time.time() - start:.0f}s")


if __name__ == "__main__":
  sys.exit(main())
