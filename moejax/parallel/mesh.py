"""Device mesh from `MeshConfig`, and the multi-host start.

Axes, outermost first: ("data", "expert", "model"). `expert` sits inside `data`, so an
expert-parallel group is a run of neighbouring devices (one host, one NVLink domain) and
its all-to-all never crosses hosts while data parallelism does.
"""
from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh

from moejax.config import Config, ConfigError, MeshConfig

AXES = ("data", "expert", "model")
TOKEN_AXES = ("data", "expert")   # the batch is split over both: EP devices see different tokens


def mesh_shape(mesh_cfg: MeshConfig, num_devices: int, num_experts: int) -> dict[str, int]:
  """Resolves -1 (all remaining devices) and checks the mesh fits the devices and experts."""
  sizes = {a: getattr(mesh_cfg, a) for a in AXES}
  if sizes["model"] != 1:
    raise ConfigError(f"mesh.model={sizes['model']}: tensor parallelism is not implemented; "
                      "use mesh.data and mesh.expert")
  free = [a for a, s in sizes.items() if s == -1]
  if len(free) > 1:
    raise ConfigError(f"mesh: only one axis may be -1 (all remaining devices), got {free}")
  fixed = int(np.prod([s for s in sizes.values() if s != -1]))
  desc = ", ".join(f"{a}={s}" for a, s in sizes.items())
  hint = ("; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N (set before jax is "
          "imported) gives N virtual devices" if jax.default_backend() == "cpu" else "")
  if free:
    if num_devices % fixed:
      raise ConfigError(f"mesh ({desc}) needs a multiple of {fixed} devices, there are "
                        f"{num_devices} ({jax.default_backend()}){hint}")
    sizes[free[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise ConfigError(
        f"mesh ({desc}): data*expert*model = {fixed} but there are {num_devices} devices "
        f"({jax.default_backend()}); set one axis to -1 to use all remaining devices{hint}")
  if num_experts % sizes["expert"]:
    raise ConfigError(f"mesh.expert={sizes['expert']} does not divide "
                      f"moe.num_experts={num_experts}")
  return sizes


def make_mesh(mesh_cfg: MeshConfig, num_experts: int, devices=None) -> Mesh:
  """A Mesh over `devices` (default: all) with axes AXES, in Auto (GSPMD) mode."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = mesh_shape(mesh_cfg, len(devices), num_experts)
  shape = tuple(sizes[a] for a in AXES)
  auto = (jax.sharding.AxisType.Auto,) * len(AXES)
  try:   # topology-aware device order where jax knows the hardware
    return jax.make_mesh(shape, AXES, axis_types=auto, devices=devices)
  except (TypeError, ValueError, NotImplementedError):
    return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=auto)


def mesh_for_config(cfg: Config) -> Mesh | None:
  """The training mesh, or None on a single device (the plain single-device code path)."""
  mesh = make_mesh(cfg.mesh, cfg.moe.num_experts)
  if mesh.size == 1:
    return None
  check_batch(mesh, cfg.data.batch_size)
  return mesh


def token_shards(mesh: Mesh) -> int:
  return int(np.prod([mesh.shape[a] for a in TOKEN_AXES]))


def check_batch(mesh: Mesh, batch_size: int) -> None:
  n = token_shards(mesh)
  if batch_size % n:
    raise ConfigError(f"data.batch_size={batch_size} must be a multiple of mesh data*expert={n} "
                      "(each device takes an equal share of the sequences)")


# ------------------------------------------------------------- multi-host ---

def maybe_initialize_distributed() -> bool:
  """Calls jax.distributed.initialize() when this process is one of several.

  Recognised: JAX_COORDINATOR_ADDRESS (host:port of process 0) + JAX_NUM_PROCESSES +
  JAX_PROCESS_ID on every host (any launcher), or SLURM (srun) / Open MPI (mpirun)
  variables, which jax reads itself. Must run before the first computation. Returns True
  when the distributed runtime is (now) up.
  """
  if jax.distributed.is_initialized():
    return True
  env = os.environ
  if env.get("JAX_COORDINATOR_ADDRESS"):
    missing = [v for v in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if not env.get(v, "").isdigit()]
    if missing:
      raise ConfigError(f"JAX_COORDINATOR_ADDRESS is set but {', '.join(missing)} is not an "
                        "integer: set all three on every host")
    if int(env["JAX_NUM_PROCESSES"]) <= 1:
      return False
    jax.distributed.initialize(env["JAX_COORDINATOR_ADDRESS"],
                               num_processes=int(env["JAX_NUM_PROCESSES"]),
                               process_id=int(env["JAX_PROCESS_ID"]))
    return True
  group = max(int(env.get(v, "1")) if env.get(v, "").isdigit() else 1
              for v in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"))
  if group <= 1:
    return False
  jax.distributed.initialize()   # SLURM / Open MPI auto-detection inside jax
  return True
