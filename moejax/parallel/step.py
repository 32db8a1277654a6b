"""Jitted train / eval steps over a mesh: explicit in/out shardings, batches placed per device.

With mesh=None these are exactly the single-device jits the training loop always used.
Whether the MoE layers exchange tokens is the model's business (built with an `ep`, see
dispatch.py); these only lay out the arrays.
"""
from __future__ import annotations

import jax
from jax.sharding import Mesh

from moejax.parallel.sharding import (batch_sharding, place, replicated, shard_batch,
                                      tree_shardings)


def place_state(mesh: Mesh | None, state, rules: dict | None = None):
  """TrainState -> the same values laid out on the mesh by the sharding rules."""
  return state if mesh is None else place(state, mesh, rules)


def jit_train_step(mesh: Mesh | None, train_step, state, rules: dict | None = None):
  """train_step(state, inputs_BT, targets_BT) -> (state, metrics), jitted with the state's
  shardings in and out (donated), the batch split over data x expert, metrics replicated."""
  if mesh is None:
    return jax.jit(train_step, donate_argnums=0)
  state_sh, batch_sh = tree_shardings(state, mesh, rules), batch_sharding(mesh)
  jitted = jax.jit(train_step, donate_argnums=0,
                   in_shardings=(state_sh, batch_sh, batch_sh),
                   out_shardings=(state_sh, replicated(mesh)))

  def step(state, inputs_BT, targets_BT):
    return jitted(state, shard_batch(mesh, inputs_BT), shard_batch(mesh, targets_BT))
  return step


def jit_eval_step(mesh: Mesh | None, eval_step, params, buffers, rules: dict | None = None):
  """eval_step(params, buffers, inputs_BT, targets_BT) -> scalars, over the mesh."""
  if mesh is None:
    return jax.jit(eval_step)
  batch_sh = batch_sharding(mesh)
  jitted = jax.jit(eval_step,
                   in_shardings=(tree_shardings(params, mesh, rules),
                                 tree_shardings(buffers, mesh, rules), batch_sh, batch_sh),
                   out_shardings=replicated(mesh))

  def step(params, buffers, inputs_BT, targets_BT):
    return jitted(params, buffers, shard_batch(mesh, inputs_BT), shard_batch(mesh, targets_BT))
  return step
