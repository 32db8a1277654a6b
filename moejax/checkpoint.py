"""orbax checkpoints of a TrainState plus the run's config.

Each step directory holds `state` (every array of the TrainState, keyed by its pytree path)
and `meta` (JSON: the config and the data position). orbax writes into a temporary
directory and renames it when complete, so an interrupted save never damages the
checkpoints already written. Resuming restores the whole TrainState; evaluation and
generation restore only params and buffers (`restore_params`, an orbax partial restore),
so they never read or allocate the optimizer state. `save_params` writes only those (a
quantized run's checkpoint, which can be evaluated but not resumed). `ParamsWriter` writes
the same params-only checkpoint a piece at a time, so the host never holds the whole model
(`moejax import`).
"""
from __future__ import annotations

import dataclasses
import shutil
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
               "moe.top_k", "moe.min_k", "moe.entropy_threshold", "model.dtype",
               "model.rope_theta", "model.norm_eps", "model.init_std", "model.max_seq_len",
               "model.clip_qkv", "model.rope_scaling", "model.rope_factor",
               "model.rope_low_freq_factor", "model.rope_high_freq_factor",
               "model.rope_original_max_len", "model.scan_layers", "model.attention_impl",
               "inference.offload"}


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


# ParamsWriter's default: host memory (a pending piece, orbax's staging of one save) against
# the number of orbax saves, each of which costs more the more came before it.
PIECE_BYTES = 64 * 2**20


def _orbax_v1():
  """orbax's v1 API (partial saves), imported only by ParamsWriter."""
  try:   # where v1 is headed: orbax's own docs import it from here
    from orbax.checkpoint import v1
  except ImportError:
    from orbax.checkpoint.experimental import v1
  return v1


class ParamsWriter:
  """The checkpoint `Checkpointer.save_params(step, ...)` writes, built a piece at a time so
  that only the arrays not yet written are held: `add` keeps arrays until `piece_bytes` are
  pending, then writes them, at most piece_bytes per orbax partial save (each its own OCDBT
  files), and drops them. `close` writes the rest, has orbax finalize the pieces into one
  PyTree checkpoint (it merges their OCDBT indices; no array data is rewritten) and makes it
  the `state` item of a step that the usual CheckpointManager writes with its `meta` item.
  The step directory appears, complete, when close returns; restore_params reads it like
  any other. One writer per step; not thread-safe."""

  def __init__(self, directory: str | Path, step: int, cfg: Config, extra: dict | None = None,
               piece_bytes: int = PIECE_BYTES):
    self.directory, self.step = Path(directory).absolute(), int(step)
    self.meta = {"config": cfg.to_dict(), "step": self.step, **(extra or {})}
    self.piece_bytes = piece_bytes
    self.pieces = 0
    # Not a step name to CheckpointManager ("<digits>" or "..._<digits>"). Pieces left by an
    # interrupted writer would join this one's checkpoint: refused, not reused.
    self._scratch = self.directory / f"{self.step}.pieces"
    stale = sorted(self.directory.glob(f"{self._scratch.name}*"))
    if stale or (self.directory / str(self.step)).exists():
      raise FileExistsError(f"{(stale or [self.directory / str(self.step)])[0]} exists")
    self._pending: dict[str, Any] = {}
    self._pending_bytes = 0
    self._written: set[str] = set()
    # The array format Checkpointer.save writes (orbax v0's default zarr2), whatever v1's.
    self._v1 = _orbax_v1()
    self._ctx = self._v1.Context()
    self._ctx.array.saving.use_zarr3 = False

  def add(self, params=None, buffers=None) -> None:
    """Parts of the params and buffers States (pytrees of arrays keyed as in the whole model,
    e.g. nnx.from_flat_state of some of its paths). Each array may be added once."""
    flat = _flatten(TrainState(params, buffers, None, None, None))
    again = sorted((self._written | set(self._pending)) & set(flat))
    if again:
      raise ValueError(f"arrays added twice: {again[:4]}")
    self._pending.update(flat)
    self._pending_bytes += sum(x.nbytes for x in flat.values())
    if self._pending_bytes >= self.piece_bytes:
      self._flush()

  def _flush(self) -> None:
    """Writes the pending arrays in saves of at most piece_bytes (an array larger than that
    alone): orbax stages what one save writes (host copies, encoded chunks)."""
    self.directory.mkdir(parents=True, exist_ok=True)
    while self._pending:
      group, size = {}, 0
      for key, x in self._pending.items():
        if group and size + x.nbytes > self.piece_bytes:
          break
        group[key], size = x, size + x.nbytes
      with self._ctx:
        self._v1.partial.save(self._scratch, group)
      for key in group:
        del self._pending[key]
      self._written |= set(group)
      self.pieces += 1
    self._pending_bytes = 0

  def close(self) -> None:
    """Writes what is pending and finalizes (class doc)."""
    self._flush()
    if not self._written:
      raise ValueError("no arrays were added")
    with self._ctx:
      self._v1.partial.finalize(self._scratch)
    # The finalized checkpoint holds one PyTree directory (v1 names it; we need not).
    trees = [p for p in self._scratch.iterdir() if p.is_dir()]
    if len(trees) != 1:
      raise RuntimeError(f"{self._scratch}: expected one PyTree directory, found "
                         f"{sorted(p.name for p in trees)}")
    # The step is assembled in the scratch directory and renamed into place whole.
    ckpt = Checkpointer(self._scratch / "steps")
    ckpt.manager.save(self.step, args=ocp.args.Composite(meta=ocp.args.JsonSave(self.meta)),
                      force=True)
    ckpt.close()
    step_dir = self._scratch / "steps" / str(self.step)
    trees[0].rename(step_dir / "state")
    step_dir.rename(self.directory / str(self.step))
    shutil.rmtree(self._scratch)


def load_run_config(run_dir: str | Path) -> Config:
  """The config stored with the latest checkpoint of a run directory."""
  ckpt = Checkpointer(Path(run_dir) / "checkpoints")
  meta = ckpt.read_meta()
  return from_dict(meta["config"])
