"""Expert parallelism on 8 virtual CPU devices.

XLA_FLAGS=--xla_force_host_platform_device_count=8 has to be set before jax is imported, so
the multi-device checks run in a subprocess: this file run as a script (`python
tests/parallel/test_parallel.py CASE...`) is the worker; it prints one JSON line of measured
differences, and the tests below assert on them. The pytest process itself keeps its one
device (mesh errors are checked there).

Tolerance: single-device vs mesh losses within 1e-5 (relative), every gradient within
1e-5 * max|gradient|, parameters after 3 Adam steps within 1e-4 (relative); float32
everywhere, so the only differences are summation order (measured: ~3e-7).

Cost: ~90 s of CPU, nearly all XLA compiles (the worker reports its time per section).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
DEVICES = 8
SMALL = ["model.d_model=16", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
         "model.head_dim=8", "model.ffn_hidden=16", "model.max_seq_len=16", "model.init_std=0.3",
         "moe.num_experts=8", "moe.top_k=2", "moe.expert_hidden=8", "data.batch_size=8",
         "data.seq_len=8", "train.warmup_steps=1", "train.tensorboard=false"]
# (data, expert) meshes x (mode, expert_impl): every mesh in both modes, impls spread over them.
# Capacity mode uses cf=4: C = T_l per device (and T on one device), so nothing drops and the
# single-device model is the exact reference; real drops are checked per routing group below.
GRAD_CASES = [((1, 8), "dropless", "ragged"), ((1, 8), "capacity", "dense"),
              ((2, 4), "dropless", "dense"), ((2, 4), "capacity", "blocked"),
              ((4, 2), "dropless", "blocked"), ((4, 2), "capacity", "ragged")]
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-5
# One case also covers top-p routing (variable experts per token) and a shared expert.
TOP_P = ["moe.routing=top_p", "moe.top_p=0.6", "moe.max_k=3", "moe.num_shared_experts=1"]


def _expert_spec() -> str:
  from jax.sharding import PartitionSpec
  return repr(PartitionSpec("expert"))


_EXPERT_SPEC = _expert_spec()


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  env["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={DEVICES} "
                      "--xla_backend_optimization_level=0")   # compile time dominates here
  return env


def _run(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, *args], env=_env(), cwd=REPO, capture_output=True,
                        text=True, timeout=timeout)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
  out = _run([__file__, str(tmp_path_factory.mktemp("ckpt"))])
  assert out.returncode == 0, out.stderr[-4000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", [f"{d}x{e}-{mode}-{impl}" for (d, e), mode, impl in GRAD_CASES])
def test_mesh_loss_and_grads_match_single_device(worker, case):
  r = worker["grads"][case]
  assert r["all_to_all_in_hlo"], "the expert-parallel exchange was not used"
  assert r["experts_per_device"] == 8 // int(case.split("-")[0].split("x")[1])
  assert r["loss_rel"] < LOSS_RTOL, r
  assert r["grad_rel"] < GRAD_RTOL, r
  assert r["aux_diff"] < 1e-5 and r["z_diff"] < 1e-4 and r["load_diff"] == 0, r
  # Every routing statistic (one implementation in model/routing.py, summed over devices on
  # the mesh) equals the single-device one.
  assert r["stats_mismatch"] == "", r["stats_mismatch"]


def test_capacity_drops_match_single_device_per_routing_group(worker):
  for impl, r in worker["drops"].items():
    assert r["dropped_frac"] > 0.05, (impl, r)     # capacity really binds
    assert r["y_rel"] < 1e-5 and r["loss_rel"] < 1e-5, (impl, r)
    assert r["grad_rel"] < GRAD_RTOL, (impl, r)
    assert r["dropped_diff"] < 1e-6, (impl, r)
  # The routing groups matter: one group for the whole batch drops other tokens.
  assert worker["drops_vs_global_rel"] > 1e-2


def test_padded_exchange_has_ragged_all_to_all_semantics(worker):
  # The example in jax.lax.ragged_all_to_all's docstring, axis of size 2.
  assert worker["ragged_emulation"] == [[1, 3, 0, 0], [2, 2, 4, 0]]


def test_training_steps_match_single_device(worker):
  from jax.sharding import PartitionSpec as P
  for name, experts, embed in (("mesh", P("expert"), P()),
                               ("fsdp", P("expert", "data"), P(None, "data"))):
    r = worker[f"steps_{name}"]
    assert r["loss_rel"] < 1e-4 and r["param_rel"] < 1e-4, (name, r)
    assert r["bias_moved"], r
    assert r["spec_experts"] == r["spec_mu_experts"] == repr(experts), (name, r)
    assert r["spec_embed"] == repr(embed), (name, r)


def test_checkpoint_restores_across_meshes(worker):
  r = worker["checkpoint"]
  assert r["to_one_device_mismatch"] == "" and r["to_one_device_single"], r
  assert r["to_mesh_mismatch"] == "" and r["to_mesh_spec"] == _EXPERT_SPEC, r


def test_cli_train_with_expert_mesh_on_8_cpu_devices(tmp_path):
  rng = np.random.default_rng(0)
  words = ["to", "be", "or", "not", "that", "is", "the", "question"]
  (tmp_path / "a.txt").write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(200)))
  out = tmp_path / "run"
  args = ["-m", "moejax.cli", "train", "configs/tiny.yaml", "mesh.expert=4", "train.steps=3",
          *[a for a in SMALL if not a.startswith("model.init_std")], "train.log_every=1",
          "train.eval_every=3", "train.eval_batches=1", "train.checkpoint_every=3",
          "data.corpus=files", f"data.files={tmp_path / 'a.txt'}", f"train.out_dir={out}"]
  res = _run(args)
  assert res.returncode == 0, res.stderr[-4000:]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["step"] == 3 and summary["mesh"] == {"data": 2, "expert": 4, "model": 1}
  assert np.isfinite(summary["val_loss"])
  assert "mesh: data=2 expert=4 model=1 over 8 cpu devices" in res.stdout
  # An impossible mesh on the same 8 devices: clear error, exit code 2.
  bad = _run(args[:4] + ["mesh.expert=2", "mesh.data=2", *args[6:]])
  assert bad.returncode == 2, bad.stderr[-2000:]
  assert "data*expert*model = 4 but there are 8 devices" in bad.stderr
  # Resume that run on this process's single device: the 2x4-mesh checkpoint restores here.
  from moejax.config import load_config
  from moejax.train import train
  overrides = [a for a in args[5:] if a not in ("mesh.expert=4", "train.steps=3")]
  summary = train(load_config("configs/tiny.yaml", overrides + ["train.steps=4"]), quiet=True)
  assert summary["step"] == 4 and summary["mesh"] is None and np.isfinite(summary["val_loss"])


# ------------------------------------------------- one device (this process) ---

def test_mesh_errors_are_clear():
  from moejax.config import ConfigError, MeshConfig
  from moejax.parallel import mesh_shape
  assert mesh_shape(MeshConfig(data=-1, expert=4), 8, 8) == {"data": 2, "expert": 4, "model": 1}
  assert mesh_shape(MeshConfig(data=2, expert=-1), 8, 8) == {"data": 2, "expert": 4, "model": 1}
  with pytest.raises(ConfigError, match="data\\*expert\\*model = 4 but there are 8 devices"):
    mesh_shape(MeshConfig(data=1, expert=4), 8, 8)
  with pytest.raises(ConfigError, match="mesh.expert=4 does not divide moe.num_experts=6"):
    mesh_shape(MeshConfig(data=1, expert=-1), 4, 6)
  with pytest.raises(ConfigError, match="mesh.expert=4 does not divide moe.num_experts=6"):
    mesh_shape(MeshConfig(data=2, expert=4), 8, 6)
  with pytest.raises(ConfigError, match="needs a multiple of 3 devices, there are 8"):
    mesh_shape(MeshConfig(data=-1, expert=3), 8, 6)
  with pytest.raises(ConfigError, match="only one axis may be -1"):
    mesh_shape(MeshConfig(data=-1, expert=-1), 8, 8)
  with pytest.raises(ConfigError, match="tensor parallelism is not implemented"):
    mesh_shape(MeshConfig(model=2), 8, 8)


class _FakeMesh:
  shape = {"data": 2, "expert": 4, "model": 1}


def test_mesh_on_one_device_and_batch_errors(tmp_path):
  from moejax import cli
  from moejax.config import ConfigError, load_config
  from moejax.parallel import check_batch, make_mesh, mesh_for_config
  cfg = load_config(None, SMALL)
  assert mesh_for_config(cfg) is None            # one device: the plain path, no mesh
  with pytest.raises(ConfigError, match="needs a multiple of 4 devices, there are 1.*xla_force_host_platform"):
    make_mesh(load_config(None, SMALL + ["mesh.expert=4"]).mesh, 8)
  with pytest.raises(ConfigError, match="data.batch_size=6 must be a multiple of mesh data"):
    check_batch(_FakeMesh, 6)
  check_batch(_FakeMesh, 16)
  assert cli.main(["train", "configs/tiny.yaml", "mesh.expert=4",
                   f"train.out_dir={tmp_path / 'x'}"]) == 2
  assert not (tmp_path / "x").exists()           # failed before writing anything


def test_logical_axes_and_specs():
  from jax.sharding import PartitionSpec as P
  from moejax.parallel import logical_axes
  from moejax.parallel.sharding import DEFAULT_RULES, FSDP_RULES, spec_for
  FakeMesh = _FakeMesh
  assert logical_axes("w_gate_EDF", 3) == ("expert", "embed", "mlp")
  assert logical_axes("w_new_EXY", 3) == ("expert", None, None)   # unknown expert weight
  assert logical_axes("something", 2) == (None, None)
  assert spec_for(("expert", "embed", "mlp"), (8, 16, 8), FakeMesh, DEFAULT_RULES) == P("expert")
  assert spec_for(("expert", "embed", "mlp"), (8, 16, 8), FakeMesh, FSDP_RULES) == P("expert", "data")
  assert spec_for(("vocab", "embed"), (256, 15), FakeMesh, FSDP_RULES) == P()  # 15 % 2: replicated
  assert spec_for(("batch",), (8,), FakeMesh, DEFAULT_RULES) == P(("data", "expert"))


# ----------------------------------------------------------------- worker ---

def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _tree_mismatch(assert_fn, *trees, **tolerances) -> str:
  """'' when the chex assertion holds, else its message (the worker reports, tests assert)."""
  try:
    assert_fn(*trees, **tolerances)
  except AssertionError as err:
    return str(err)[:2000]
  return ""


def _worker(ckpt_dir: str) -> dict:
  import chex
  import jax
  import jax.numpy as jnp
  from moejax import parallel
  from moejax.checkpoint import Checkpointer
  from moejax.config import load_config
  from moejax.model import routing
  from moejax.model.experts import expert_ffn
  from jax.sharding import PartitionSpec as P
  from moejax.parallel.dispatch import moe_experts, padded_ragged_all_to_all
  from moejax.state import build_model, forward_loss, init_state, make_train_step, split_model
  assert jax.device_count() == DEVICES, jax.devices()
  rng = np.random.default_rng(0)
  x_BT = rng.integers(0, 256, (8, 8)).astype(np.int32)
  y_BT = rng.integers(0, 256, (8, 8)).astype(np.int32)
  out: dict = {"grads": {}, "drops": {}, "seconds": {}}
  clock = [time.perf_counter()]

  def lap(name):   # where the worker's time goes (compiles dominate)
    now = time.perf_counter()
    out["seconds"][name] = round(now - clock[0], 1)
    clock[0] = now

  def mesh_of(cfg, d, e):
    return parallel.make_mesh(load_config(None, SMALL + [f"mesh.data={d}", f"mesh.expert={e}"]
                                          ).mesh, 8)

  def graphdef_on(cfg, mesh):   # the model's structure with its MoE layers expert-parallel
    return split_model(build_model(cfg, cfg.train.seed, parallel.expert_parallel(mesh)))[0]

  # Loss and gradients, every mesh x mode. Nothing drops, so one single-device reference
  # (per routing variant) serves every impl and mode.
  refs = {}
  for (d, e), mode, impl in GRAD_CASES:
    variant = TOP_P if (d, e) == (2, 4) and mode == "dropless" else []
    extra = [f"moe.expert_impl={impl}", "moe.capacity_factor=" + ("4" if mode == "capacity" else "0")]
    cfg = load_config(None, SMALL + extra + variant)
    graphdef, state = init_state(cfg)
    vg = lambda gd: jax.value_and_grad(
        lambda p, b, x, y: forward_loss(cfg, gd, p, b, x, y), has_aux=True)
    if tuple(variant) not in refs:
      refs[tuple(variant)] = jax.jit(vg(graphdef))(state.params, state.buffers, x_BT, y_BT)
    (l0, m0), g0 = refs[tuple(variant)]
    mesh = mesh_of(cfg, d, e)
    p, b = parallel.place(state.params, mesh), parallel.place(state.buffers, mesh)
    xs, ys = parallel.shard_batch(mesh, x_BT), parallel.shard_batch(mesh, y_BT)
    fn = jax.jit(vg(graphdef_on(cfg, mesh)))
    hlo = fn.lower(p, b, xs, ys).as_text()
    (l1, m1), g1 = fn(p, b, xs, ys)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g0))
    w = [v for k, v in jax.tree_util.tree_flatten_with_path(p)[0] if "w_up_EDF" in str(k)][0]
    out["grads"][f"{d}x{e}-{mode}-{impl}"] = {
        "loss_rel": abs(float(l1) - float(l0)) / abs(float(l0)),
        "grad_rel": max(float(jnp.max(jnp.abs(a - c))) for a, c in
                        zip(jax.tree.leaves(g0), jax.tree.leaves(g1))) / scale,
        "aux_diff": abs(float(m1["aux_loss"] - m0["aux_loss"])),
        "z_diff": abs(float(m1["z_loss"] - m0["z_loss"])),
        "load_diff": float(np.abs(np.asarray(m1["load_LE"]) - np.asarray(m0["load_LE"])).max()),
        "stats_mismatch": _tree_mismatch(chex.assert_trees_all_close, m1, m0, rtol=2e-5,
                                         atol=1e-6),
        "all_to_all_in_hlo": "all_to_all" in hlo,
        "experts_per_device": int(w.addressable_shards[0].data.shape[0]),
    }

  lap("grads")
  # Real drops (cf=1): the mesh equals one device applied to each device's tokens as its own
  # routing group, outputs and gradients (through the combine weights, the router and the
  # aux / z losses, which stay global).
  m = load_config(None, SMALL + ["moe.capacity_factor=1"]).moe
  keys = jax.random.split(jax.random.key(1), 6)
  T, D, E, F, G = 64, 16, m.num_experts, m.expert_hidden, DEVICES
  x_TD = jax.random.normal(keys[0], (T, D))
  cot_TD = jax.random.normal(keys[5], (T, D))
  params = (jax.random.normal(keys[1], (D, E)) * 2.0,
            *[jax.random.normal(k, sh) * 0.3 for k, sh in
              zip(keys[2:5], [(E, D, F), (E, D, F), (E, F, D)])])

  def grouped_reference(params):
    router_DE, *ws = params

    def one_group(x_TD):
      C = routing.capacity(x_TD.shape[0], m.top_k, E, m.capacity_factor)
      r = routing.route(x_TD @ router_DE, mode=m.routing, top_k=m.top_k,
                        renormalize=m.renormalize, capacity=C)
      return expert_ffn("dense", x_TD, r.expert_TK, r.weight_TK, r.keep_TK, *ws, capacity=C), r
    y, r = jax.vmap(one_group)(x_TD.reshape(G, T // G, D))
    flat = lambda a: a.reshape(T, *a.shape[2:])
    aux = routing.load_balancing_loss(flat(r.probs_TE), flat(r.expert_TK), flat(r.selected_TK))
    loss = jnp.sum(y.reshape(T, D) * cot_TD) + aux + routing.router_z_loss(flat(r.logits_TE))
    return loss, (y.reshape(T, D), 1 - r.keep_TK.sum() / (T * m.top_k))

  (l0, (y0, dropped0)), g0 = jax.jit(jax.value_and_grad(grouped_reference, has_aux=True))(params)
  mesh = mesh_of(None, 2, 4)
  for impl in ("dense", "ragged", "gmm"):
    mi = dataclasses.replace(m, expert_impl=impl)

    def on_mesh(params):
      y, st = moe_experts(mesh, mi, x_TD, params[0], None, *params[1:])
      return jnp.sum(y * cot_TD) + st["aux_loss"] + st["z_loss"], (y, st["dropped_frac"])
    (l1, (y1, dropped1)), g1 = jax.jit(jax.value_and_grad(on_mesh, has_aux=True))(params)
    out["drops"][impl] = {"y_rel": _rel(y1, y0), "loss_rel": _rel(l1, l0),
                          "grad_rel": max(_rel(a, c) for a, c in zip(g1, g0)),
                          "dropped_frac": float(dropped1),
                          "dropped_diff": abs(float(dropped1) - float(dropped0))}
  # ... and differs from one device taking the whole batch as a single routing group.
  C = routing.capacity(T, m.top_k, E, m.capacity_factor)
  r = routing.route(x_TD @ params[0], mode=m.routing, top_k=m.top_k, renormalize=m.renormalize,
                    capacity=C)
  out["drops_vs_global_rel"] = _rel(
      y0, expert_ffn("dense", x_TD, r.expert_TK, r.weight_TK, r.keep_TK, *params[1:], capacity=C))

  lap("drops")
  # The CPU stand-in for ragged_all_to_all reproduces the example of its documentation.
  mesh2 = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",),
                            axis_types=(jax.sharding.AxisType.Auto,))
  args = [np.array(v, np.float32 if i < 2 else np.int32) for i, v in enumerate([
      [[1, 2, 2], [3, 4, 0]], [[0] * 4] * 2, [[0, 1], [0, 1]], [[1, 2], [1, 1]],
      [[0, 0], [1, 2]], [[1, 1], [2, 1]]])]
  got = jax.jit(jax.shard_map(
      lambda *a: padded_ragged_all_to_all(*[v[0] for v in a], axis_name="x")[None],
      mesh=mesh2, in_specs=(P("x"),) * 6, out_specs=P("x")))(*args)
  out["ragged_emulation"] = np.asarray(got).tolist()

  lap("emulation")
  # Three training steps (router biases on), single device vs EP=4 x DP=2.
  cfg = load_config(None, SMALL + ["moe.bias_balancing=true", "moe.bias_update_rate=0.01",
                                   "train.steps=3"])
  graphdef, state0 = init_state(cfg)
  mesh = mesh_of(cfg, 2, 4)
  batches = [(rng.integers(0, 256, (8, 8)).astype(np.int32),
              rng.integers(0, 256, (8, 8)).astype(np.int32)) for _ in range(3)]
  runs = {}
  for name, msh, rules in (("single", None, None), ("mesh", mesh, None),
                           ("fsdp", mesh, parallel.FSDP_RULES)):
    state = parallel.place_state(msh, init_state(cfg)[1], rules)
    gd = graphdef if msh is None else graphdef_on(cfg, msh)
    step = parallel.jit_train_step(msh, make_train_step(cfg, gd), state, rules)
    losses = []
    for x, y in batches:
      state, metrics = step(state, x, y)
      losses.append(float(metrics["loss"]))
    runs[name] = (state, losses)
  (s0, l0) = runs["single"]
  spec = lambda state, name: repr([v.sharding.spec for k, v in jax.tree_util.tree_flatten_with_path(
      state.params)[0] if name in str(k)][0])
  for name in ("mesh", "fsdp"):
    s1, l1 = runs[name]
    out[f"steps_{name}"] = {
        "loss_rel": _rel(l1, l0),
        "param_rel": max(_rel(a, c) for a, c in zip(jax.tree.leaves(s1), jax.tree.leaves(s0))
                         if np.asarray(c).dtype.kind == "f"),
        "bias_moved": bool(any(np.abs(np.asarray(v)).sum() > 0
                               for v in jax.tree.leaves(s1.buffers))),
        "spec_experts": spec(s1, "w_gate_EDF"), "spec_embed": spec(s1, "embed_VD"),
        # Adam moments live where their parameters do.
        "spec_mu_experts": repr([v.sharding.spec for k, v in jax.tree_util.tree_flatten_with_path(
            s1.opt_state)[0] if "mu" in str(k) and "w_gate_EDF" in str(k)][0]),
    }
  s1 = runs["mesh"][0]

  lap("steps")
  # Checkpoint saved on the EP=4 x DP=2 mesh, restored onto one device; and the reverse.
  ck = Checkpointer(Path(ckpt_dir) / "a")
  ck.save(3, s1, cfg, wait=True)
  restored, _ = ck.restore(init_state(cfg)[1], cfg)
  leaves = jax.tree.leaves(restored)
  ck2 = Checkpointer(Path(ckpt_dir) / "b")
  ck2.save(3, s0, cfg, wait=True)
  on_mesh, _ = ck2.restore(parallel.place_state(mesh, init_state(cfg)[1]), cfg)
  spec = [v.sharding.spec for k, v in jax.tree_util.tree_flatten_with_path(on_mesh.params)[0]
          if "w_down_EFD" in str(k)][0]
  out["checkpoint"] = {
      "to_one_device_mismatch": _tree_mismatch(chex.assert_trees_all_equal, restored, s1),
      "to_one_device_single": all(len(x.sharding.device_set) == 1 for x in leaves),
      "to_mesh_mismatch": _tree_mismatch(chex.assert_trees_all_equal, on_mesh, s0),
      "to_mesh_spec": repr(spec),
  }
  ck.close()
  ck2.close()
  lap("checkpoint")
  return out


def _ragged_check() -> dict:
  """ragged_all_to_all vs the padded stand-in, on a backend that has it (GPU/TPU, >= 2
  devices): `JAX_PLATFORMS=cuda python tests/parallel/test_parallel.py --ragged-check`."""
  import jax
  import jax.numpy as jnp
  from moejax import parallel
  from moejax.config import MeshConfig, load_config
  from moejax.parallel.dispatch import moe_experts
  n = jax.device_count()
  mesh = parallel.make_mesh(MeshConfig(data=1, expert=n), 8)
  out = {"backend": jax.default_backend(), "devices": n}
  for impl in ("ragged", "dense"):
    m = load_config(None, SMALL + [f"moe.expert_impl={impl}"]).moe
    keys = jax.random.split(jax.random.key(0), 5)
    x_TD = jax.random.normal(keys[0], (64 * n, 16))
    params = (jax.random.normal(keys[1], (16, 8)),
              *[jax.random.normal(k, sh) * 0.3 for k, sh in
                zip(keys[2:], [(8, 16, 8), (8, 16, 8), (8, 8, 16)])])
    res = {}
    for exchange in ("ragged", "padded"):
      f = lambda p: jnp.sum(moe_experts(mesh, m, x_TD, p[0], None, *p[1:],
                                        exchange=exchange)[0] ** 2)
      res[exchange] = jax.jit(jax.value_and_grad(f))(params)
    (l0, g0), (l1, g1) = res["padded"], res["ragged"]
    out[impl] = {"loss_rel": _rel(l1, l0), "grad_rel": max(_rel(a, c) for a, c in zip(g1, g0))}
  return out


if __name__ == "__main__":
  if sys.argv[1] == "--ragged-check":
    print(json.dumps(_ragged_check()))
  else:
    print(json.dumps(_worker(sys.argv[1])))
