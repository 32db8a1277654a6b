"""Loading a trained run's model (params and router biases only) for eval and generation."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from flax import nnx

from moejax.checkpoint import Checkpointer, load_run_config
from moejax.config import Config, ConfigError, load_config, with_overrides
from moejax.data import Tokenizer
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


def load_trained(run_dir: str | Path, overrides: list[str] | None = None) -> TrainedModel:
  """Restores the model of a run directory's latest checkpoint (written by `moejax train`):
  params and router biases only, into an abstract target (no optimizer state, no
  initialization)."""
  run_dir = Path(run_dir)
  if not (run_dir / "checkpoints").is_dir():
    raise FileNotFoundError(f"{run_dir} is not a run directory (no checkpoints/ inside)")
  saved = load_run_config(run_dir)
  _warn_if_edited(run_dir, saved)
  cfg = with_overrides(saved, overrides or [])
  graphdef, params, buffers = abstract_model(cfg)
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
      if var[...].dtype != dtype and jnp.issubdtype(var[...].dtype, jnp.floating):
        var.set_value(var[...].astype(dtype))
  return split_model(model)
