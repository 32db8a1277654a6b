"""Loading a trained run's model (params and router biases only) for eval and generation."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.checkpoint import Checkpointer, load_run_config
from moejax.config import Config, ConfigError, load_config, with_overrides
from moejax.data import Tokenizer
from moejax.model.moe import FLOAT_EXPERT_NAMES, QUANTIZED_EXPERT_NAMES
from moejax.run_io import load_tokenizer
from moejax.state import abstract_model, split_model


@dataclasses.dataclass
class TrainedModel:
  cfg: Config
  graphdef: Any
  params: Any
  buffers: Any
  tokenizer: Tokenizer
  step: int

  def module(self):
    return nnx.merge(self.graphdef, self.params, self.buffers)


EXPERT_NAMES = frozenset(FLOAT_EXPERT_NAMES + QUANTIZED_EXPERT_NAMES)


def is_expert_path(path) -> bool:
  """A routed expert weight's leaf in a params pytree (path: jax key path; its Param's name
  is the key before the Variable's `value`)."""
  names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
  return any(n in EXPERT_NAMES for n in names[-2:])


def _place_experts(params, sharding):
  """The abstract params with the routed expert leaves restored into `sharding`."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
      if is_expert_path(path) else x, params)


def load_trained(run_dir: str | Path, overrides: list[str] | None = None,
                 expert_sharding: jax.sharding.Sharding | None = None) -> TrainedModel:
  """Restores the model of a run directory's latest checkpoint (written by `moejax train`):
  params and router biases only, into an abstract target (no optimizer state, no
  initialization). expert_sharding: where the routed experts are restored instead of the
  device, e.g. a pinned_host memory kind for expert offload (offload.host_placement), so a
  model whose experts do not fit in HBM loads."""
  run_dir = Path(run_dir)
  if not (run_dir / "checkpoints").is_dir():
    raise FileNotFoundError(f"{run_dir} is not a run directory (no checkpoints/ inside)")
  saved = load_run_config(run_dir)
  _warn_if_edited(run_dir, saved)
  cfg = with_overrides(saved, overrides or [])
  graphdef, params, buffers = abstract_model(cfg)
  if expert_sharding is not None:
    params = _place_experts(params, expert_sharding)
  params, buffers, meta = Checkpointer(run_dir / "checkpoints").restore_params(
      params, buffers, cfg)
  return TrainedModel(cfg, graphdef, params, buffers, load_tokenizer(cfg, run_dir),
                      int(meta["step"]))


def _warn_if_edited(run_dir: Path, saved: Config) -> None:
  """The checkpoint's config is the run's config; config.yaml is a copy for reading. Say so
  when the copy was edited, instead of silently ignoring the edit."""
  path = run_dir / "config.yaml"
  try:
    copy = load_config(path).to_dict() if path.is_file() else None
  except ConfigError:
    copy = None
  if copy is None:
    return
  ref = saved.to_dict()
  diff = [f"{s}.{k}" for s in ref if s not in ("train", "mesh")
          for k in ref[s] if copy[s].get(k) != ref[s][k]]
  if diff:
    print(f"note: {path} differs from the checkpoint's config in {', '.join(diff)}; the "
          f"checkpoint's is used (pass key=value overrides to change a setting)",
          file=sys.stderr)


# Matmul weights the model casts to its compute dtype where it uses them: stored in that
# dtype, a float32-param model reads half the bytes per step and converts nothing.
_CAST_AT_USE = frozenset({"wqkv_DP", "wo_HdD", "w_gate_EDF", "w_up_EDF", "w_down_EFD",
                          "w_gate_DF", "w_up_DF", "w_down_FD",
                          "embed_VD", "lm_head_DV"})


def decode_layout(graphdef: Any, params: Any, buffers: Any):
  """(graphdef, params, buffers) in the layout the decode programs run, computing exactly
  what the checkpoint layout computes: each attention's q, k, v weights fused into one
  (Attention.fuse_projections) and the matmul weights in the compute dtype
  (model.dtype). Not a checkpoint layout."""
  model = nnx.merge(graphdef, params, buffers)
  for block in model.blocks:
    block.attn.fuse_projections()
  dtype = model.dtype
  for path, var in nnx.iter_graph(model):
    if isinstance(var, nnx.Param) and path and path[-1] in _CAST_AT_USE:
      # Weights kept in host memory stay as stored (an eager cast would bring them to the
      # device); the programs cast them at use, which computes the same.
      kind = getattr(getattr(var[...], "sharding", None), "memory_kind", None)
      if (var[...].dtype != dtype and jnp.issubdtype(var[...].dtype, jnp.floating)
          and kind in (None, "device")):
        var.set_value(var[...].astype(dtype))
  return split_model(model)
