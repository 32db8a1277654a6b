"""Scaling out: device mesh, logical-axis sharding rules, expert-parallel dispatch.

  mesh.py      Mesh from MeshConfig (clear errors), multi-host jax.distributed start
  sharding.py  logical axes of every parameter -> PartitionSpecs; batch placement
  dispatch.py  expert-parallel MoE in jax.shard_map (all_to_all / ragged_all_to_all) and
               `ExpertParallel`, the object handed to `Transformer(..., ep=...)`
  step.py      train / eval steps jitted with in/out shardings

This package imports the model, never the reverse: a model runs expert-parallel only when
it is built with an `ep` (see `expert_parallel`).
"""
from moejax.parallel.dispatch import ExpertParallel, expert_parallel, resolve_exchange
from moejax.parallel.mesh import (AXES, TOKEN_AXES, check_batch, make_mesh,
                                  maybe_initialize_distributed, mesh_for_config, mesh_shape)
from moejax.parallel.sharding import (DEFAULT_RULES, FSDP_RULES, batch_sharding, logical_axes,
                                      place, shard_batch, tree_shardings, tree_specs)
from moejax.parallel.step import jit_eval_step, jit_train_step, place_state
