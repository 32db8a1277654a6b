"""Expert offload at decode (issue 36): ms per token, hit rate and host-to-device traffic
under HBM budgets of 25 / 50 / 75 % of the experts, for the lru, lfu and predictive policies.

One run, one process:
  probe      what the JAX mechanism does here: memory kinds; whether jax.device_put from
             pinned host memory returns before its copy ends; a jitted read of a host-memory
             array at a traced expert index (does it compile, how long it takes against a copy
             of one expert, i.e. does XLA move one expert or all E); the in-jit slot write;
             host-to-device rate by transfer granularity (one array, an expert's arrays, k
             experts in one call or k calls); whether a copy overlaps a computation
             dispatched after it.
  H2D        bandwidth of a pinned-host -> device copy of one expert (all its weights).
  in-HBM     ms per decode step with every expert resident (the same engine, all slots,
             preloaded), on as many layers as fit (--hbm-layers), extended to the full
             depth from two depths.
  rows       per (budget, policy): decode ms per token (median over the steps after
             --warmup), hit rate, MB moved host -> device per token, prefetches used /
             wasted, and the ratio step / max(moved bytes / H2D bandwidth, in-HBM step) per
             step (median and max; the goal is <= 1.2).
Weights are random, built one layer at a time (bf16 as the config says) with each layer's
experts copied straight to pinned host memory, so the experts never have to fit the device.

  python experiments/bench_offload.py                         # Mixtral-8x7B shape, GPU
  python experiments/bench_offload.py --layers 8 --budgets 50
  python experiments/bench_offload.py --smoke                 # tiny shapes, CPU, < 1 minute
  python experiments/bench_offload.py --run runs/reference_gpu --predictor learned
      # a trained run: its weights, held-out text as prompts, sampled continuations (the
      # same tokens under every policy: offload is exact); --predictor learned reads the
      # run's predictor.npz (moejax train-predictor)
Prints the table; writes JSON to $OUT/bench_offload.json (or --out).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

# The pool is most of the card at a 75 % budget: let the allocator have it (XLA's default
# preallocates 75 % of the memory).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
# XLA's pinned host allocator stops at 64 GB by default; Mixtral's bf16 experts are 90 GB.
os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(int(
    0.9 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30)))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from moejax.atomic import write_atomic  # noqa: E402
from moejax.config import load_config, with_overrides  # noqa: E402
from moejax.inference.offload import OffloadModel, host_placement  # noqa: E402
from moejax.inference.offload_engine import OffloadEngine  # noqa: E402
from moejax.model.layers import RMSNorm, dtype_of, normal_init  # noqa: E402
from moejax.model.transformer import Block  # noqa: E402

SMOKE = ["model.d_model=64", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=32",
         "model.vocab_size=256", "model.max_seq_len=256", "moe.num_experts=4",
         "moe.expert_hidden=64", "moe.expert_impl=ragged", "model.init_std=0.2",
         "data.seq_len=64", "data.bpe_vocab_size=256"]


def build(cfg, placement, seed=0) -> OffloadModel:
  """Random weights, one block at a time: its experts go to `placement` before the next is
  built, so the device holds at most one layer's experts."""
  m = cfg.model
  pdtype = dtype_of(m.param_dtype)
  init = normal_init(m.init_std)
  key = jax.random.key(seed)
  embed = init(jax.random.fold_in(key, 0), (m.vocab_size, m.d_model), pdtype)
  head = None if m.tie_embeddings else init(jax.random.fold_in(key, 1), (m.d_model, m.vocab_size),
                                            pdtype)
  om = OffloadModel(cfg, embed, RMSNorm(m.d_model, eps=m.norm_eps, param_dtype=pdtype), head,
                    placement)
  for i in range(m.num_layers):
    om.add_block(Block(cfg, i, rngs=nnx.Rngs(params=seed + 1 + i)))
    gc.collect()
  return om


def from_run(run_dir: str, placement, lookahead: int, predictor: str):
  """A trained run's OffloadModel, its validation tokens, and the predictor to prefetch
  with ("gate", or the run's learned maps for lookahead 1..d)."""
  from moejax.inference.load import load_trained
  from moejax.inference.prefetch import load_predictor
  from moejax.run_io import load_data
  tm = load_trained(run_dir)
  om = OffloadModel.from_split(tm.cfg, tm.graphdef, tm.params, tm.buffers, placement)
  chosen = predictor
  if predictor == "learned":
    chosen = load_predictor(run_dir, tm, list(range(1, lookahead + 1)))[0]
  return om, load_data(tm.cfg, Path(run_dir)).val, chosen


def _ready(x):
  return jax.block_until_ready(x)


def _median_s(fn, reps=5):
  fn()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def h2d_bandwidth(om: OffloadModel, reps: int) -> float:
  """Bytes/s of jax.device_put of one expert's host arrays to the device, to completion."""
  leaves = om.host[om.moe_layers[0]][0]
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
  return om.expert_bytes / _median_s(lambda: _ready(jax.device_put(leaves, dev)), reps)


def probe(om: OffloadModel, reps: int) -> dict:
  """The mechanism questions (module doc), on one expert weight matrix of the model."""
  dev0 = jax.devices()[0]
  out = {"memory_kinds": sorted(m.kind for m in dev0.addressable_memories()),
         "host_placement": None if om.placement is None else om.placement.memory_kind}
  dev = jax.sharding.SingleDeviceSharding(dev0, memory_kind="device")
  layer = om.moe_layers[0]
  w_host = om.host[layer][0][0]                      # one expert's first weight matrix
  nbytes = int(w_host.nbytes)
  out["matrix_MB"] = nbytes / 1e6
  # 1. device_put: return time vs completion.
  t0 = time.perf_counter()
  y = jax.device_put(w_host, dev)
  t_ret = time.perf_counter() - t0
  _ready(y)
  out["device_put_return_ms"] = 1e3 * t_ret
  out["device_put_done_ms"] = 1e3 * (time.perf_counter() - t0)
  t_one = _median_s(lambda: _ready(jax.device_put(w_host, dev)), reps)
  out["device_put_GBps"] = nbytes / t_one / 1e9
  # 2. a traced index into a stacked host-memory array [E, ...] inside jit, three ways.
  if om.placement is not None:
    E = om.num_experts
    stacked = jax.device_put(jnp.stack([jax.device_put(om.host[layer][e][0], dev)
                                        for e in range(E)]), om.placement)
    want = np.asarray(om.host[layer][E - 1][0], np.float32)
    index = lambda w, e: jax.lax.dynamic_index_in_dim(w, e, 0, keepdims=False)
    ways = {"put_all_then_index": jax.jit(lambda w, e: index(jax.device_put(w, dev), e)),
            "index_then_put": jax.jit(lambda w, e: jax.device_put(index(w, e), dev)),
            "index_out_device": jax.jit(index, out_shardings=dev)}
    for name, fn in ways.items():
      try:
        got = _ready(fn(stacked, jnp.int32(E - 1)))
        t = _median_s(lambda: _ready(fn(stacked, jnp.int32(1))), reps)
        out[f"traced_index_{name}"] = dict(
            correct=bool(np.array_equal(np.asarray(got, np.float32), want)),
            memory_kind=got.sharding.memory_kind, ms=1e3 * t, one_expert_put_ms=1e3 * t_one,
            experts_moved_equiv=t / t_one)
      except Exception as err:  # noqa: BLE001  (the finding is that it fails)
        out[f"traced_index_{name}"] = dict(error=f"{type(err).__name__}: {err}"[:300])
    del stacked
    # 3. the in-jit slot write, against device_put + device write.
    from moejax.inference import offload as off
    pool = [jnp.zeros((2,) + w_host.shape, w_host.dtype)]
    holder = [pool]

    def in_jit():
      holder[0] = off.write_slot_from_host(holder[0], (w_host,), np.int32(1), dev)
      _ready(holder[0])

    def staged():
      holder[0] = off.write_slot(holder[0], [jax.device_put(w_host, dev)], np.int32(1))
      _ready(holder[0])

    out["in_jit_write_ms"] = 1e3 * _median_s(in_jit, reps)
    out["device_put_then_write_ms"] = 1e3 * _median_s(staged, reps)
    del holder, pool
  # 4. transfer granularity: one expert's bytes as one array and as its weight arrays; k
  # experts in one device_put call and in k calls (per-call vs per-array vs per-byte cost).
  if om.placement is not None:
    experts = [list(om.host[layer][e]) for e in range(min(4, om.num_experts))]
    k, eb = len(experts), om.expert_bytes
    flat = jax.device_put(jnp.concatenate([jax.device_put(x, dev).ravel() for x in experts[0]]),
                          om.placement)
    ways = {"one_array": (lambda: _ready(jax.device_put(flat, dev)), eb),
            "expert_arrays": (lambda: _ready(jax.device_put(experts[0], dev)), eb),
            f"{k}_experts_one_call": (lambda: _ready(jax.device_put(sum(experts, []), dev)),
                                      k * eb),
            f"{k}_experts_{k}_calls": (lambda: _ready([jax.device_put(x, dev) for x in experts]),
                                       k * eb)}
    out["h2d_GBps_by_granularity"] = {name: nb / _median_s(fn, reps) / 1e9
                                      for name, (fn, nb) in ways.items()}
    del flat
  # 5. overlap: a copy issued, then a computation dispatched; both waited for together.
  n = 256 if dev0.platform == "cpu" else 4096
  a = jnp.full((n, n), 1 / n, jnp.bfloat16)

  @jax.jit
  def compute(a):
    return jax.lax.fori_loop(0, 16, lambda i, x: jnp.tanh(x @ a), a)

  t_compute = _median_s(lambda: _ready(compute(a)), reps)
  t_both = _median_s(lambda: _ready((jax.device_put(w_host, dev), compute(a))), reps)
  out.update(compute_ms=1e3 * t_compute, copy_ms=1e3 * t_one, copy_and_compute_ms=1e3 * t_both,
             overlap=(t_one + t_compute - t_both) / max(min(t_one, t_compute), 1e-9))
  return out


def decode_steps(eng: OffloadEngine, prompt, steps: int, warmup: int, sampling=None
                 ) -> list[dict]:
  """A warm-up call (compiles, fills the cache), then one timed generate; its decode forwards
  after the first `warmup`. sampling: None greedy, else (SamplingConfig, seed)."""
  kw = {} if sampling is None else dict(sampling=sampling[0], seed=sampling[1])
  eng.generate(prompt, 2, **kw)
  eng.reset_stats()
  eng.generate(prompt, steps + warmup, **kw)
  return [f for f in eng.forward_log if f["phase"] == "decode"][warmup:]


def in_hbm_ms(om: OffloadModel, hbm_layers: int, prompt, steps, warmup, sampling=None,
              **kw) -> tuple:
  """Median decode step with every expert resident, at the full depth: measured at
  hbm_layers, or extended linearly from hbm_layers // 2 and hbm_layers."""
  L = om.cfg.model.num_layers
  depths = [L] if hbm_layers >= L else sorted({max(1, hbm_layers // 2), hbm_layers})
  times, misses = [], 0
  for n in depths:
    sub = om if n == L else om.truncated(n)
    eng = OffloadEngine(sub, slots=len(sub.moe_layers) * sub.num_experts, policy="lru", **kw)
    eng.preload()   # all resident before the first step: no cold miss in the timed ones
    log = decode_steps(eng, prompt, steps, warmup, sampling)
    times.append(statistics.median(f["seconds"] for f in log))
    misses += sum(f["misses"] for f in log)
    del eng, sub
    gc.collect()
  if len(depths) == 1:
    return times[0], depths, misses
  per_layer = (times[1] - times[0]) / (depths[1] - depths[0])
  return times[1] + per_layer * (L - depths[1]), depths, misses


def row(om, budget, policy, prompt, steps, warmup, bw, t_hbm, sampling=None, **kw) -> dict:
  total = len(om.moe_layers) * om.num_experts
  slots = max(1, round(budget / 100 * total))
  eng = OffloadEngine(om, slots=slots, policy=policy, **kw)
  log = decode_steps(eng, prompt, steps, warmup, sampling)
  s, eb, B = eng.stats["decode"], om.expert_bytes, len(prompt)
  moved = [(f["misses"] + f["prefetches"]) * eb for f in log]
  ratios = [f["seconds"] / max(b / bw, t_hbm) for f, b in zip(log, moved)]
  out = dict(budget_pct=budget, policy=policy, slots=slots, total_experts=total,
             ms_per_token=1e3 * statistics.median(f["seconds"] for f in log),
             hit_rate=s.hit_rate, MB_h2d_per_token=float(np.mean(moved)) / 1e6 / B,
             misses_per_step=s.misses / max(s.forwards, 1),
             prefetches_per_step=s.prefetches / max(s.forwards, 1),
             prefetch_used=s.prefetch_used, prefetch_wasted=s.prefetch_wasted,
             floor_ms=1e3 * statistics.median(max(b / bw, t_hbm) for b in moved),
             ratio_median=statistics.median(ratios), ratio_max=max(ratios),
             pool_GB=slots * eb / 1e9)
  del eng
  gc.collect()
  return out


HEADER = (f"{'budget':>6s} {'policy':>10s} {'slots':>5s} {'ms/tok':>9s} {'hit':>5s} "
          f"{'MB/tok':>8s} {'miss/st':>7s} {'pf/st':>6s} {'pf used':>7s} {'wasted':>6s} "
          f"{'floor ms':>9s} {'ratio':>6s} {'max':>6s}")


def format_row(r: dict) -> str:
  return (f"{r['budget_pct']:5d}% {r['policy']:>10s} {r['slots']:5d} {r['ms_per_token']:9.2f} "
          f"{r['hit_rate']:5.2f} {r['MB_h2d_per_token']:8.1f} {r['misses_per_step']:7.2f} "
          f"{r['prefetches_per_step']:6.2f} {r['prefetch_used']:7d} {r['prefetch_wasted']:6d} "
          f"{r['floor_ms']:9.2f} {r['ratio_median']:6.2f} {r['ratio_max']:6.2f}")


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("overrides", nargs="*", help="config key=value overrides")
  p.add_argument("--config", default="configs/mixtral_8x7b.yaml")
  p.add_argument("--layers", type=int, default=0, help="cut the model to this depth")
  p.add_argument("--hbm-layers", type=int, default=0,
                 help="layers for the all-resident time (0: what fits in --hbm-fraction)")
  p.add_argument("--hbm-fraction", type=float, default=0.6)
  p.add_argument("--budgets", type=int, nargs="+", default=[25, 50, 75])
  p.add_argument("--policies", nargs="+", default=["lru", "lfu", "predictive"])
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--prompt", type=int, default=16)
  p.add_argument("--steps", type=int, default=16, help="timed decode steps")
  p.add_argument("--warmup", type=int, default=4, help="decode steps left out of the timing")
  p.add_argument("--lookahead", type=int, default=2)
  p.add_argument("--prefetch-width", type=int, default=0, help="0: top_k")
  p.add_argument("--transfer", default="device_put", choices=["device_put", "in_jit"])
  p.add_argument("--host-memory", default=None, help="pinned_host | unpinned_host | numpy")
  p.add_argument("--run", default=None, help="a trained run directory instead of random "
                 "weights of --config")
  p.add_argument("--predictor", default="gate", choices=["gate", "learned"],
                 help="predictive policy's predictor (learned: --run's predictor.npz)")
  p.add_argument("--temperature", type=float, default=0.8, help="--run: sampling (0 greedy)")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--no-probe", action="store_true")
  p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, < 1 minute)")
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  if a.run and (a.smoke or a.layers or a.overrides):
    p.error("--run takes the run's own config: no --smoke, --layers or overrides")
  if a.predictor == "learned" and not a.run:
    p.error("--predictor learned needs --run (the run's predictor.npz)")
  cfg = load_config(a.config)
  if a.smoke:
    cfg = with_overrides(cfg, SMOKE)
    a.layers, a.steps, a.warmup, a.prompt, a.reps = a.layers or 3, 6, 2, 8, 2
  cfg = with_overrides(cfg, list(a.overrides) + ([f"model.num_layers={a.layers}"]
                                                  if a.layers else []))
  dev = jax.devices()[0]
  result = dict(date=time.strftime("%Y-%m-%d"), device=getattr(dev, "device_kind", str(dev)),
                jax=jax.__version__, config=a.config, overrides=a.overrides,
                layers=cfg.model.num_layers, batch=a.batch, lookahead=a.lookahead,
                transfer=a.transfer, rows=[])
  t0 = time.perf_counter()
  placement = host_placement(a.host_memory)
  predictor, sampling, rng = "gate", None, np.random.default_rng(0)
  if a.run:
    om, val, predictor = from_run(a.run, placement, a.lookahead, a.predictor)
    cfg = om.cfg
    starts = rng.integers(0, len(val) - a.prompt, a.batch)
    prompt = [val[s:s + a.prompt].tolist() for s in starts]
    if a.temperature > 0:
      from moejax.inference.sampling import SamplingConfig
      sampling = (SamplingConfig(a.temperature, 40, 1.0), 0)
    result.update(run=a.run, config=None, predictor=a.predictor, temperature=a.temperature,
                  layers=cfg.model.num_layers)
  else:
    om = build(cfg, placement)
    prompt = [rng.integers(0, cfg.model.vocab_size, a.prompt).tolist() for _ in range(a.batch)]
  result["build_s"] = time.perf_counter() - t0
  eb, total = om.expert_bytes, len(om.moe_layers) * om.num_experts
  result.update(expert_MB=eb / 1e6, experts_GB=total * eb / 1e9)
  print(f"device {result['device']}, jax {jax.__version__}; {cfg.model.num_layers} layers, "
        f"{total} experts of {eb / 1e6:.1f} MB ({total * eb / 1e9:.2f} GB) in "
        f"{'numpy' if placement is None else placement.memory_kind}; built in "
        f"{result['build_s']:.1f} s")
  if not a.no_probe:
    result["probe"] = probe(om, a.reps)
    print("probe:", json.dumps(result["probe"], indent=None, default=str))
  bw = h2d_bandwidth(om, a.reps)
  result["h2d_GBps"] = bw / 1e9
  print(f"H2D (pinned -> device, one expert): {bw / 1e9:.2f} GB/s, "
        f"{1e3 * eb / bw:.2f} ms an expert")
  kw = dict(transfer=a.transfer)
  hbm_layers = a.hbm_layers
  if not hbm_layers:
    limit = (dev.memory_stats() or {}).get("bytes_limit") if dev.platform != "cpu" else None
    per_layer = om.num_experts * eb * len(om.moe_layers) / cfg.model.num_layers
    hbm_layers = (cfg.model.num_layers if limit is None
                  else max(1, int(a.hbm_fraction * limit // per_layer)))
  t_hbm, depths, hbm_misses = in_hbm_ms(om, hbm_layers, prompt, a.steps, a.warmup, sampling,
                                        **kw)
  result.update(in_hbm_ms=1e3 * t_hbm, in_hbm_depths=depths, in_hbm_misses=hbm_misses)
  print(f"in-HBM decode step: {1e3 * t_hbm:.2f} ms (all experts resident; measured at "
        f"{depths} layers; {hbm_misses} misses in the timed steps)")
  out = a.out or os.path.join(os.environ.get("OUT", "."), "bench_offload.json")
  save = lambda result: write_atomic(Path(out), json.dumps(result, indent=1, default=str))
  print(HEADER)
  for budget in a.budgets:
    for policy in a.policies:
      extra = dict(lookahead=a.lookahead, prefetch_width=a.prefetch_width or None,
                   predictor=predictor) if policy == "predictive" else {}
      try:
        r = row(om, budget, policy, prompt, a.steps, a.warmup, bw, t_hbm, sampling, **kw,
                **extra)
        print(format_row(r))
      except Exception as err:  # noqa: BLE001  (one row failing, e.g. out of memory, is a row)
        r = dict(budget_pct=budget, policy=policy, error=f"{type(err).__name__}: {err}"[:300])
        print(f"{budget:5d}% {policy:>10s} ERROR {r['error']}")
      result["rows"].append(r)
      save(result)   # a run cut short keeps the rows it timed
  result["total_s"] = time.perf_counter() - t0
  save(result)
  print(f"\n{out} ({result['total_s']:.0f} s)")
  return result


if __name__ == "__main__":
  main()
