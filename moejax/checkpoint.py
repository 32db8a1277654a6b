"""orbax checkpoints of a TrainState plus the run's config.

Each step directory holds `state` (every array of the TrainState, keyed by its pytree path)
and `meta` (JSON: the config and the data position). orbax writes into a temporary
directory and renames it when complete, so an interrupted save never damages the
checkpoints already written. Resuming restores the whole TrainState; evaluation and
generation restore only params and buffers (`restore_params`, an orbax partial restore),
so they never read or allocate the optimizer state. `save_params` writes only those (a
quantized run's checkpoint, which can be evaluated but not resumed).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from moejax.config import Config, InferenceConfig, from_dict
from moejax.state import TrainState


class CheckpointMismatchError(ValueError):
  """The checkpoint was written for a different model/config."""


def _flatten(tree) -> dict[str, Any]:
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def _unflatten(template, flat: dict[str, Any]):
  leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
  return jax.tree_util.tree_unflatten(
      treedef, [flat[jax.tree_util.keystr(path)] for path, _ in leaves])


def _abstract(x):
  """Restore target of one array: its shape, dtype and sharding (default: first device)."""
  sharding = getattr(x, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


# Sections whose values change the parameter shapes: a mismatch there cannot be restored.
_SHAPE_SECTIONS = ("model", "moe", "inference")
_SHAPE_FREE = {"moe.routing", "moe.renormalize", "moe.top_p", "moe.max_k", "moe.capacity_factor",
               "moe.expert_impl", "moe.aux_loss_coef", "moe.z_loss_coef", "moe.bias_update_rate",
               "moe.top_k", "model.dtype", "model.rope_theta", "model.norm_eps", "model.init_std",
               "model.max_seq_len", "model.clip_qkv", "model.rope_scaling", "model.rope_factor",
               "model.rope_low_freq_factor", "model.rope_high_freq_factor",
               "model.rope_original_max_len"}


def config_mismatches(saved: dict, current: Config) -> list[str]:
  """'section.key: saved -> current' for every setting that changes parameter shapes."""
  out = []
  cur = current.to_dict()
  # A checkpoint older than the inference section holds float experts (its defaults); the
  # group size shapes nothing while both sides keep 16-bit experts.
  saved = {**saved, "inference": {**dataclasses.asdict(InferenceConfig()), **saved.get("inference", {})}}
  float_experts = saved["inference"]["expert_bits"] == current.inference.expert_bits == 16
  for section in _SHAPE_SECTIONS:
    for key, value in saved.get(section, {}).items():
      name = f"{section}.{key}"
      if name in _SHAPE_FREE or (name == "inference.expert_group_size" and float_experts):
        continue
      if cur[section].get(key) != value:
        out.append(f"{name}: checkpoint has {value!r}, config has {cur[section].get(key)!r}")
  return out


class Checkpointer:
  """Periodic saves with keep-N; restore of the latest (or a given) step."""

  def __init__(self, directory: str | Path, keep: int = 3):
    self.directory = Path(directory).absolute()
    # One handler for `state` whatever the call: a full and a partial restore need the
    # PyTree handler (the Standard one cannot restore a subset), and saves must match it.
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, cfg: Config, extra: dict | None = None, wait: bool = False):
    meta = {"config": cfg.to_dict(), "step": int(step), **(extra or {})}
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeSave(_flatten(state)), meta=ocp.args.JsonSave(meta)), force=True)
    if wait:
      self.manager.wait_until_finished()

  def save_params(self, step: int, params, buffers, cfg: Config, extra: dict | None = None):
    """A checkpoint of the model's arrays only (no optimizer state, step or RNG), for
    restore_params: what `moejax quantize` writes. Waits until it is on disk."""
    self.save(step, TrainState(params, buffers, None, None, None), cfg, extra, wait=True)

  def read_meta(self, step: int | None = None) -> dict:
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def restore(self, template, cfg: Config, step: int | None = None):
    """Restores into the structure (and shardings) of `template`, whose leaves may be arrays
    or jax.ShapeDtypeStructs. -> (state, meta). Every array of the template must be in the
    checkpoint; arrays the template lacks (e.g. opt_state=None) are neither read nor
    allocated."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    meta = self.read_meta(step)
    problems = config_mismatches(meta["config"], cfg)
    if problems:
      raise CheckpointMismatchError(
          f"checkpoint {self.directory}/{step} does not match the config:\n  " + "\n  ".join(problems))
    flat_template = _flatten(template)
    saved = set(self.manager.item_metadata(step)["state"])
    missing = set(flat_template) - saved
    if missing:
      raise CheckpointMismatchError(f"checkpoint lacks arrays: {sorted(missing)[:5]}")
    abstract = {k: _abstract(v) for k, v in flat_template.items()}
    restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
        partial_restore=True)))["state"]
    for k, v in flat_template.items():
      if tuple(restored[k].shape) != tuple(v.shape):
        raise CheckpointMismatchError(
            f"array {k}: checkpoint shape {restored[k].shape}, model shape {v.shape}")
    return _unflatten(template, restored), meta

  def restore_params(self, params, buffers, cfg: Config, step: int | None = None):
    """Only the model's arrays, for evaluation and generation. -> (params, buffers, meta)."""
    state, meta = self.restore(TrainState(params, buffers, None, None, None), cfg, step)
    return state.params, state.buffers, meta

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


def load_run_config(run_dir: str | Path) -> Config:
  """The config stored with the latest checkpoint of a run directory."""
  ckpt = Checkpointer(Path(run_dir) / "checkpoints")
  meta = ckpt.read_meta()
  return from_dict(meta["config"])
