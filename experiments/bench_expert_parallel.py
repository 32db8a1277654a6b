"""Expert-parallel (EP x DP) scaling of the MoE train step and of decode on 1, 2, 4, 8 devices.

GPU, one host with 8 H200 (NVLink multicast stays off; the script forces NCCL_NVLS_ENABLE=0):
  NCCL_NVLS_ENABLE=0 PYTHONPATH=. python3 experiments/bench_expert_parallel.py --preset gpu
CPU check (8 virtual devices share the host cores: validates the script, not scaling):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python experiments/bench_expert_parallel.py \
      model.num_layers=2 data.seq_len=32 --devices 1 2 4 8 --steps 3 --warmup 1 --decode-steps 5

Config: configs/tiny.yaml (or --config), then --preset gpu, then key=value overrides.
Every run uses the framework's own path: parallel.make_mesh over the first n devices, a
model built with parallel.expert_parallel(mesh, mesh.exchange), place_state, jit_train_step
(tokens split over data x expert, expert weights over `expert`). The dropless exchange is
the config's mesh.exchange (auto | ragged | padded), e.g. `mesh.exchange=padded`.

  weak    n devices train E = E0*n experts on B = B0*n sequences, mesh expert=n (E_l = E0).
          B0 = data.batch_size / max(n) unless --weak-batch. Efficiency t1 / tn.
  strong  fixed E0 and B = data.batch_size, mesh expert=n. Efficiency t1 / (n * tn).
  decode  the strong-scaling model, experts sharded over n devices: a jitted forward of one
          new token per sequence (greedy argmax fed back), no KV cache, batch 1 and 64. The
          EP dispatch splits tokens over devices, so a batch smaller than data*expert is padded
          with copies up to it; tokens/s counts the real batch only.

Exchange share (a2a %): each configuration is also compiled with every all_to_all /
ragged_all_to_all that dispatch.py issues replaced by a local identity of the same shape
(no communication, same shapes and expert compute; the local pack/unpack stays), and timed
interleaved with the real step in the same process. a2a % = 1 - t(no exchange) / t(real):
the time the token exchange adds to the step, including waiting for peers (load imbalance
and sync). It does not count the data-parallel gradient all-reduce GSPMD inserts.
Timing: median of --steps steps after --warmup, each ended by jax.block_until_ready, on
random tokens (never zeros). JSON -> $OUT/bench_expert_parallel.json (default ".").
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import time
from pathlib import Path

# NVLink multicast (NVLS) must stay off on the device machines; set before any backend starts.
if os.environ.get("NCCL_NVLS_ENABLE", "0") != "0":
  print(f"NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']} overridden to 0")
os.environ["NCCL_NVLS_ENABLE"] = "0"

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax import parallel
from moejax.config import load_config
from moejax.model.transformer import active_params
from moejax.parallel.mesh import token_shards
from moejax.state import build_model, init_state, make_train_step, split_model

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
# ~0.5B active params at E0=8; weak scaling to E=64 on 8 GPUs (~3B params). Random tokens.
GPU_PRESET = ["model.vocab_size=32000", "model.d_model=1024", "model.num_layers=8",
              "model.num_heads=8", "model.num_kv_heads=4", "model.head_dim=128",
              "model.ffn_hidden=4096", "model.max_seq_len=2048", "model.tie_embeddings=false",
              "model.dtype=bfloat16", "model.param_dtype=float32", "moe.num_experts=8",
              "moe.top_k=2", "moe.expert_hidden=2048", "moe.expert_impl=gmm",
              "data.tokenizer=bpe", "data.bpe_vocab_size=32000", "data.seq_len=2048",
              "data.batch_size=32"]


# ------------------------------------------------------------ no exchange ---

def _identity_all_to_all(x, axis_name, split_axis, concat_axis, *, axis_index_groups=None,
                         tiled=False):
  assert split_axis == concat_axis, "identity stand-in needs split_axis == concat_axis"
  return x


def _local_ragged_all_to_all(operand, output, *_, axis_name, **__):
  """Same output shape as the real one, filled from this device's own rows."""
  N, M = operand.shape[0], output.shape[0]
  y = operand[:M] if N >= M else jnp.pad(operand, [(0, M - N)] + [(0, 0)] * (operand.ndim - 1))
  return y.astype(output.dtype)


@contextlib.contextmanager
def _patched_exchange(calls: list):
  real = jax.lax.all_to_all, jax.lax.ragged_all_to_all

  def count(fn):
    def f(*a, **k):
      calls.append(fn.__name__)
      return fn(*a, **k)
    return f
  jax.lax.all_to_all = count(_identity_all_to_all)
  jax.lax.ragged_all_to_all = count(_local_ragged_all_to_all)
  try:
    yield
  finally:
    jax.lax.all_to_all, jax.lax.ragged_all_to_all = real


def without_exchange(fn, calls: list):
  """fn traced with the EP exchanges replaced (the patch is active only while tracing)."""
  @functools.wraps(fn)
  def wrapped(*a, **k):
    with _patched_exchange(calls):
      return fn(*a, **k)
  return wrapped


# --------------------------------------------------------------- helpers ---

def make_cfg(base: list[str], n: int, ep: int, experts: int, batch: int):
  return load_config(base[0], base[1:] + [f"moe.num_experts={experts}", f"data.batch_size={batch}",
                                          f"mesh.expert={ep}", f"mesh.data={n // ep}"])


def mesh_over(cfg, n: int):
  """The config's mesh over the first n devices; None for one device (single-device path)."""
  if n == 1:
    return None
  mesh = parallel.make_mesh(cfg.mesh, cfg.moe.num_experts, jax.devices()[:n])
  parallel.check_batch(mesh, cfg.data.batch_size)
  return mesh


def timed(fn, reps: int) -> list[float]:
  out = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    out.append(time.perf_counter() - t)
  return out


def bench_train(cfg, n: int, steps: int, warmup: int) -> dict:
  """Real step and no-exchange step, interleaved; -> times and shapes."""
  mesh = mesh_over(cfg, n)
  ep = parallel.expert_parallel(mesh, cfg.mesh.exchange)
  graphdef, state0 = init_state(cfg, build_model(cfg, cfg.train.seed, ep))
  state0 = parallel.place_state(mesh, state0)
  train_step = make_train_step(cfg, graphdef)
  calls: list = []
  fns = {"real": parallel.jit_train_step(mesh, train_step, state0)}
  if mesh is not None:
    fns["noex"] = parallel.jit_train_step(mesh, without_exchange(train_step, calls), state0)
  states = {k: jax.tree.map(lambda x: x.copy(), state0) for k in fns}
  del state0
  B, T = cfg.data.batch_size, cfg.data.seq_len
  rng = np.random.default_rng(0)
  batches = [rng.integers(0, cfg.model.vocab_size, (B, T + 1)).astype(np.int32) for _ in range(4)]
  times = {k: [] for k in fns}
  compile_s, losses = {}, {}
  for i in range(warmup + steps):
    x = batches[i % 4]
    for k, fn in fns.items():
      t = time.perf_counter()
      states[k], m = fn(states[k], x[:, :-1], x[:, 1:])
      jax.block_until_ready((states[k], m))
      dt = time.perf_counter() - t
      if i == 0:
        compile_s[k] = dt
      if i >= warmup:
        times[k].append(dt)
      losses[k] = float(m["loss"])
  if mesh is not None and not calls:
    raise RuntimeError("no exchange was replaced: the step did not take the EP dispatch path")
  t_real = float(np.median(times["real"]))
  t_noex = float(np.median(times["noex"])) if "noex" in times else None
  return {"mesh": dict(mesh.shape) if mesh is not None else {"data": 1, "expert": 1},
          "experts": cfg.moe.num_experts, "batch": B, "tokens": B * T,
          "active_params": active_params(cfg),
          "params": int(sum(x.size for x in jax.tree.leaves(states["real"].params))),
          "step_ms": 1e3 * t_real, "tokens_per_s": B * T / t_real,
          "noex_step_ms": None if t_noex is None else 1e3 * t_noex,
          "a2a_share": None if t_noex is None else max(0.0, 1.0 - t_noex / t_real),
          "compile_s": compile_s["real"], "loss": losses["real"],
          "step_ms_all": [1e3 * t for t in times["real"]]}


def bench_decode(cfg, n: int, batch: int, steps: int, warmup: int) -> dict:
  """One new token per sequence per step through the whole model, experts sharded over n."""
  mesh = mesh_over(cfg, n)
  n_tok = token_shards(mesh) if mesh is not None else 1
  Bp = -(-batch // n_tok) * n_tok   # padded to a multiple of data*expert
  ep = parallel.expert_parallel(mesh, cfg.mesh.exchange)
  graphdef, params, buffers = split_model(build_model(cfg, cfg.train.seed, ep))

  def decode_step(params, buffers, tok_B1):
    logits_B1V, _, _ = nnx.merge(graphdef, params, buffers)(tok_B1)
    return jnp.argmax(logits_B1V[:, -1], -1).astype(jnp.int32)[:, None]

  calls: list = []
  variants = {"real": decode_step}
  if mesh is not None:
    variants["noex"] = without_exchange(decode_step, calls)
    params = parallel.place(params, mesh)
    buffers = parallel.place(buffers, mesh)
    bsh = parallel.batch_sharding(mesh)
    jit = lambda f: jax.jit(f, out_shardings=bsh, in_shardings=(
        parallel.tree_shardings(params, mesh), parallel.tree_shardings(buffers, mesh), bsh))
  else:
    jit = jax.jit
  fns = {k: jit(f) for k, f in variants.items()}
  tok0 = np.random.default_rng(1).integers(0, cfg.model.vocab_size, (Bp, 1)).astype(np.int32)
  toks = {k: parallel.shard_batch(mesh, tok0) if mesh is not None else jnp.asarray(tok0)
          for k in fns}
  times = {k: [] for k in fns}
  for i in range(warmup + steps):
    for k, fn in fns.items():
      t = time.perf_counter()
      toks[k] = jax.block_until_ready(fn(params, buffers, toks[k]))
      if i >= warmup:
        times[k].append(time.perf_counter() - t)
  if mesh is not None and not calls:
    raise RuntimeError("no exchange was replaced: decode did not take the EP dispatch path")
  t_real = float(np.median(times["real"]))
  t_noex = float(np.median(times["noex"])) if "noex" in times else None
  return {"mesh": dict(mesh.shape) if mesh is not None else {"data": 1, "expert": 1},
          "experts": cfg.moe.num_experts, "batch": batch, "padded_batch": Bp,
          "step_ms": 1e3 * t_real, "tokens_per_s": batch / t_real,
          "noex_step_ms": None if t_noex is None else 1e3 * t_noex,
          "a2a_share": None if t_noex is None else max(0.0, 1.0 - t_noex / t_real)}


# ------------------------------------------------------------------ main ---

def _fmt(x, f="{:.1f}"):
  return "" if x is None else f.format(x)


def _mesh_str(m):
  return f"{m['data']}x{m['expert']}"


def print_tables(res: dict):
  print(f"\n{res['date']}; {res['n_available']} x {res['device_kind']} ({res['backend']}); "
        f"jax {res['jax']}; NCCL env {res['nccl_env'] or '{}'}")
  for mode in ("weak", "strong"):
    print(f"\n{mode} scaling (mesh = data x expert; efficiency "
          f"{'t1/tn' if mode == 'weak' else 't1/(n*tn)'})\n")
    print("| n | mesh | experts (per dev) | batch x seq | step ms | tokens/s | efficiency "
          "| no-exchange ms | a2a % of step |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in res[mode]:
      if "error" in r:
        print(f"| {r['n']} | error: {r['error'][:100]} |")
        continue
      e_dev = r["experts"] // r["mesh"]["expert"]
      print(f"| {r['n']} | {_mesh_str(r['mesh'])} | {r['experts']} ({e_dev})"
            f" | {r['batch']}x{r['tokens'] // r['batch']} | {r['step_ms']:.1f} | "
            f"{r['tokens_per_s']:.0f} | {_fmt(r.get('efficiency'), '{:.0%}')} | "
            f"{_fmt(r['noex_step_ms'])} | {_fmt(r['a2a_share'] and 100 * r['a2a_share'])} |")
  print("\ndecode (one token per sequence per step, no KV cache; strong-scaling model)\n")
  print("| n | mesh | batch (padded) | step ms | tokens/s | no-exchange ms | a2a % of step |")
  print("|---:|---|---:|---:|---:|---:|---:|")
  for r in res["decode"]:
    if "error" in r:
      print(f"| {r['n']} | error: {r['error'][:100]} |")
      continue
    print(f"| {r['n']} | {_mesh_str(r['mesh'])} | {r['batch']} ({r['padded_batch']}) | "
          f"{r['step_ms']:.2f} | {r['tokens_per_s']:.0f} | {_fmt(r['noex_step_ms'], '{:.2f}')} | "
          f"{_fmt(r['a2a_share'] and 100 * r['a2a_share'])} |")


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("overrides", nargs="*",
                 help="key.sub=value config overrides (before the options, or after --)")
  p.add_argument("--config", default=str(TINY))
  p.add_argument("--preset", choices=["tiny", "gpu"], default="tiny")
  p.add_argument("--devices", type=int, nargs="+",
                 help="device counts (default: 1, 2, 4, 8 up to the devices present)")
  p.add_argument("--ep", type=int, default=0, help="cap on mesh.expert (rest goes to data); 0: n")
  p.add_argument("--weak-batch", type=int, default=0, help="B0 per unit of n (default B / max n)")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--decode-batches", type=int, nargs="*", default=[1, 64])
  p.add_argument("--decode-steps", type=int, default=20)
  p.add_argument("--skip", nargs="*", default=[], choices=["weak", "strong", "decode"])
  args = p.parse_args()

  avail = jax.device_count()
  devices = args.devices or [n for n in (1, 2, 4, 8) if n <= avail]
  base = [args.config] + (GPU_PRESET if args.preset == "gpu" else []) + args.overrides
  cfg0 = load_config(base[0], base[1:])
  E0, B = cfg0.moe.num_experts, cfg0.data.batch_size
  B0 = args.weak_batch or max(1, B // max(devices))
  nccl = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
  res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
         "n_available": avail, "jax": jax.__version__, "nccl_env": nccl,
         "xla_flags": os.environ.get("XLA_FLAGS", ""), "config": base,
         "exchange": parallel.resolve_exchange(cfg0.mesh.exchange), "steps": args.steps,
         "warmup": args.warmup,
         "weak": [], "strong": [], "decode": []}
  print(f"devices {devices} of {avail} {jax.default_backend()}; E0={E0} B={B} B0(weak)={B0}; "
        f"exchange {res['exchange']}; NCCL env {nccl}", flush=True)

  def run(mode, n, fn):
    if n > avail:
      r = {"n": n, "error": f"only {avail} devices"}
    else:
      try:
        r = {"n": n, **fn()}
      except Exception as err:   # record and go on: one OOM must not hide the other rows
        r = {"n": n, "error": f"{type(err).__name__}: {err}"[:400]}
    res[mode].append(r)
    print(mode, json.dumps({k: v for k, v in r.items() if k != "step_ms_all"}), flush=True)

  for n in devices:
    ep = min(n, args.ep) if args.ep else n
    if "weak" not in args.skip:
      run("weak", n, lambda: bench_train(make_cfg(base, n, ep, E0 * n, B0 * n), n, args.steps,
                                         args.warmup))
    if "strong" not in args.skip:
      run("strong", n, lambda: bench_train(make_cfg(base, n, ep, E0, B), n, args.steps,
                                           args.warmup))
    if "decode" not in args.skip:
      for b in args.decode_batches:
        run("decode", n, lambda: bench_decode(make_cfg(base, n, ep, E0, B), n, b,
                                              args.decode_steps, args.warmup))
  for mode, scale in (("weak", lambda t1, r: t1 / r["step_ms"]),
                      ("strong", lambda t1, r: t1 / (r["n"] * r["step_ms"]))):
    ok = [r for r in res[mode] if "error" not in r]
    t1 = next((r["step_ms"] for r in ok if r["n"] == 1), None)
    for r in ok:
      r["efficiency"] = scale(t1, r) if t1 else None
  out = Path(os.environ.get("OUT", "."))
  out.mkdir(parents=True, exist_ok=True)
  (out / "bench_expert_parallel.json").write_text(json.dumps(res, indent=2))
  print_tables(res)


if __name__ == "__main__":
  main()
