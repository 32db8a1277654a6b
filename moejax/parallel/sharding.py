"""Logical axis names for every parameter, rules mapping them to mesh axes, and placement.

A parameter's logical axes come from its name (the shape letters in names are the
convention: w_gate_EDF is (expert, embed, mlp)). Rules turn logical axes into mesh axes:

  DEFAULT_RULES  experts' leading E axis along `expert`; everything else replicated.
  FSDP_RULES     additionally the `embed` axis of every matrix along `data` (ZeRO-3 style:
                 GSPMD gathers a weight where it is used and reduce-scatters its gradient).

Optimizer moments mirror the parameter tree, so they get the same specs by the same names;
scalars (step, Adam count) and anything unnamed are replicated. A mesh axis that does not
divide a dimension is left out for that dimension (the array stays replicated along it).
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moejax.parallel.mesh import TOKEN_AXES

# parameter name -> logical axis of each dimension
LOGICAL_AXES: dict[str, tuple[str | None, ...]] = {
    "embed_VD": ("vocab", "embed"),
    "lm_head_DV": ("embed", "vocab"),
    "wq_DHd": ("embed", "heads"),
    "wk_DKd": ("embed", "kv_heads"),
    "wv_DKd": ("embed", "kv_heads"),
    "wo_HdD": ("heads", "embed"),
    "w_gate_DF": ("embed", "mlp"),
    "w_up_DF": ("embed", "mlp"),
    "w_down_FD": ("mlp", "embed"),
    "router_DE": ("embed", None),
    "w_gate_EDF": ("expert", "embed", "mlp"),
    "w_up_EDF": ("expert", "embed", "mlp"),
    "w_down_EFD": ("expert", "mlp", "embed"),
    "scale": ("norm",),
    "bias_E": (None,),
}

DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {"expert": "expert", "batch": TOKEN_AXES}
FSDP_RULES = {**DEFAULT_RULES, "embed": "data"}


def logical_axes(name: str, ndim: int) -> tuple[str | None, ...]:
  """Known names from LOGICAL_AXES; else `*_E...` arrays of 3 dims are experts-first."""
  axes = LOGICAL_AXES.get(name)
  if axes is not None and len(axes) == ndim:
    return axes
  suffix = name.rsplit("_", 1)[-1] if "_" in name else ""
  if ndim == 3 and suffix.startswith("E") and len(suffix) == 3:
    return ("expert", None, None)
  return (None,) * ndim


def spec_for(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh,
             rules: dict) -> P:
  """Logical axes -> PartitionSpec, skipping mesh axes that are size 1, absent, or don't divide."""
  out, used = [], set()
  for logical, dim in zip(axes, shape):
    mesh_axes = rules.get(logical) if logical is not None else None
    mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
    mesh_axes = tuple(a for a in mesh_axes if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
    n = int(np.prod([mesh.shape[a] for a in mesh_axes])) if mesh_axes else 1
    if not mesh_axes or dim % n:
      out.append(None)
      continue
    used.update(mesh_axes)
    out.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def _leaf_name(path) -> str:
  """The last dict key on a pytree path: the parameter name (nnx states are dicts)."""
  for key in reversed(path):
    if isinstance(key, jax.tree_util.DictKey):
      return str(key.key)
  return ""


def tree_specs(tree, mesh: Mesh, rules: dict | None = None):
  """PartitionSpec for every array leaf of a params / optimizer / TrainState tree."""
  rules = DEFAULT_RULES if rules is None else rules
  return jax.tree_util.tree_map_with_path(
      lambda path, x: spec_for(logical_axes(_leaf_name(path), np.ndim(x)), np.shape(x), mesh,
                               rules), tree)


def tree_shardings(tree, mesh: Mesh, rules: dict | None = None):
  return jax.tree.map(lambda s: NamedSharding(mesh, s), tree_specs(tree, mesh, rules))


def place(tree, mesh: Mesh, rules: dict | None = None):
  """device_put every leaf with its rule-derived sharding."""
  return jax.device_put(tree, tree_shardings(tree, mesh, rules))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """[B, ...] batches: sequences split over data x expert."""
  return NamedSharding(mesh, P(TOKEN_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def shard_batch(mesh: Mesh, x) -> jax.Array:
  """A host batch (the same global array on every process) -> a global array split over
  data x expert; each process keeps only its devices' rows, so this works multi-host."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, batch_sharding(mesh), lambda idx: x[idx])
