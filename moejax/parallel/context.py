"""Which mesh the MoE layers dispatch over while a step is being traced.

The model stays mesh-agnostic: a jitted step runs its body under `use_mesh(mesh)`, and
`MoE.__call__` asks `active()`; with no active mesh (or a one-device mesh) it takes the
plain single-device path. Read at trace time only, so a plain module-level stack is enough.
"""
from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

from jax.sharding import Mesh


class EPContext(NamedTuple):
  mesh: Mesh
  exchange: str   # dropless token exchange: auto | ragged | padded (see dispatch.py)


_STACK: list[EPContext | None] = []


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None, exchange: str = "auto"):
  _STACK.append(EPContext(mesh, exchange) if mesh is not None and mesh.size > 1 else None)
  try:
    yield
  finally:
    _STACK.pop()


def active() -> EPContext | None:
  return _STACK[-1] if _STACK else None


def with_mesh(mesh: Mesh | None, fn, exchange: str = "auto"):
  """fn, traced under use_mesh(mesh)."""
  if mesh is None:
    return fn

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with use_mesh(mesh, exchange):
      return fn(*args, **kwargs)
  return wrapped
