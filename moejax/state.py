"""Model construction, train state, and the pure train/eval step functions.

TrainState is a plain pytree so that jit, shardings and orbax see arrays only:
  params   nnx.State of nnx.Param        (optimized)
  buffers  nnx.State of RouterBias       (aux-loss-free balancing; updated in the step)
  opt_state, step (int32), rng (key data, uint32)
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from moejax.config import Config, ConfigError
from moejax.model import routing
from moejax.model.moe import RouterBias
from moejax.model.transformer import Transformer

if TYPE_CHECKING:
  from moejax.parallel.dispatch import ExpertParallel


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
  params: Any
  buffers: Any
  opt_state: Any
  step: jax.Array
  rng: jax.Array


def build_model(cfg: Config, seed: int, ep: ExpertParallel | None = None) -> Transformer:
  """ep: the MoE layers' expert-parallel dispatch (parallel.expert_parallel), None on one device."""
  return Transformer(cfg, rngs=nnx.Rngs(params=seed), ep=ep)


def lr_schedule(cfg: Config) -> optax.Schedule:
  """Linear warmup from 0 to train.lr, cosine decay to lr * min_lr_ratio at train.steps."""
  t = cfg.train
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=t.lr, warmup_steps=min(t.warmup_steps, t.steps),
      decay_steps=max(t.steps, t.warmup_steps + 1), end_value=t.lr * t.min_lr_ratio)


def make_optimizer(cfg: Config, schedule: optax.Schedule | None = None
                   ) -> optax.GradientTransformation:
  t = cfg.train
  schedule = lr_schedule(cfg) if schedule is None else schedule
  # No weight decay on norms scales (1-D parameters).
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  return optax.chain(
      optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity(),
      optax.adamw(schedule, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=decay_mask))


def split_model(model: Transformer):
  """-> (graphdef, params, buffers)."""
  graphdef, params, buffers = nnx.split(model, nnx.Param, RouterBias)
  return graphdef, params, buffers


def abstract_model(cfg: Config):
  """(graphdef, params, buffers) with jax.ShapeDtypeStruct leaves: a restore target that
  allocates nothing (see Checkpointer.restore_params)."""
  return split_model(nnx.eval_shape(lambda: build_model(cfg, cfg.train.seed)))


def check_trainable(cfg: Config) -> None:
  """Quantized experts are integer codes: no gradients, no optimizer. Refused up front."""
  if cfg.inference.expert_bits != 16:
    raise ConfigError(
        f"inference.expert_bits={cfg.inference.expert_bits}: quantized expert weights are for "
        "inference (eval, generate) and cannot be trained; train with inference.expert_bits=16, "
        "then quantize the trained run: moejax quantize RUN_DIR OUT_DIR --expert-bits "
        f"{cfg.inference.expert_bits}")


def fill_state(template, flat: dict):
  """The nnx State of `template` (abstract leaves) with the values of `flat`, keyed by the
  template's flat paths; a missing or extra path, or a shape / dtype the template does not
  have, is an error naming it."""
  target = dict(nnx.to_flat_state(template))
  if set(flat) != set(target):
    raise ValueError(f"parameter trees differ: {sorted(set(flat) ^ set(target))[:4]}")
  for path, var in target.items():
    want, got = var.get_value(), flat[path]
    if (tuple(want.shape), want.dtype) != (tuple(got.shape), got.dtype):
      raise ValueError(f"{path}: built {got.shape} {got.dtype}, the model has "
                       f"{want.shape} {want.dtype}")
  return nnx.from_flat_state({path: var.replace(flat[path]) for path, var in target.items()})


def init_state(cfg: Config, model: Transformer | None = None) -> tuple[Any, TrainState]:
  check_trainable(cfg)
  model = model if model is not None else build_model(cfg, cfg.train.seed)
  graphdef, params, buffers = split_model(model)
  opt_state = make_optimizer(cfg).init(params)
  rng = jax.random.key_data(jax.random.key(cfg.train.seed))
  return graphdef, TrainState(params, buffers, opt_state, jnp.zeros((), jnp.int32), rng)


def abstract_state(cfg: Config, ep: ExpertParallel | None = None) -> tuple[Any, TrainState]:
  """init_state's (graphdef, TrainState) with jax.ShapeDtypeStruct leaves: lowers and
  compiles a train step of any size without allocating the model."""
  graphdef, params, buffers = split_model(
      nnx.eval_shape(lambda: build_model(cfg, cfg.train.seed, ep)))
  opt_state = jax.eval_shape(make_optimizer(cfg).init, params)
  rng = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
  return graphdef, TrainState(params, buffers, opt_state,
                              jax.ShapeDtypeStruct((), jnp.int32), rng)


def lm_loss(logits_BTV, targets_BT):
  """Mean next-token cross-entropy in nats (float32)."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits_BTV.astype(jnp.float32), targets_BT).mean()


def forward_loss(cfg: Config, graphdef, params, buffers, inputs_BT, targets_BT):
  """Total loss = LM loss + aux_loss_coef * Switch loss + z_loss_coef * z-loss (layer means)."""
  model = nnx.merge(graphdef, params, buffers)
  logits, stats, _ = model(inputs_BT)
  lm = lm_loss(logits, targets_BT)
  zero = jnp.zeros((), jnp.float32)
  aux = jnp.mean(jnp.stack([s["aux_loss"] for s in stats])) if stats else zero
  z = jnp.mean(jnp.stack([s["z_loss"] for s in stats])) if stats else zero
  total = lm + cfg.moe.aux_loss_coef * aux + cfg.moe.z_loss_coef * z
  metrics = {"loss": lm, "aux_loss": aux, "z_loss": z, "total_loss": total}
  if stats:
    metrics["load_LE"] = jnp.stack([s["load_E"] for s in stats])
    metrics["dropped_L"] = jnp.stack([s["dropped_frac"] for s in stats])
    metrics["experts_per_token"] = jnp.mean(jnp.stack([s["experts_per_token"] for s in stats]))
  return total, metrics


def update_router_biases(cfg: Config, graphdef, params, buffers, load_LE):
  """Aux-loss-free balancing: nudge each MoE layer's selection bias toward equal load."""
  if not cfg.moe.bias_balancing:
    return buffers
  model = nnx.merge(graphdef, params, buffers)
  moe_blocks = [b for b in model.blocks if b.is_moe]
  for block, load_E in zip(moe_blocks, load_LE):
    block.ffn.bias_E[...] = routing.bias_update(block.ffn.bias_E[...], load_E,
                                                 cfg.moe.bias_update_rate)
  return split_model(model)[2]


def make_train_step(cfg: Config, graphdef):
  schedule = lr_schedule(cfg)
  tx = make_optimizer(cfg, schedule)

  def train_step(state: TrainState, inputs_BT, targets_BT):
    grad_fn = jax.value_and_grad(
        lambda p: forward_loss(cfg, graphdef, p, state.buffers, inputs_BT, targets_BT),
        has_aux=True)
    (_, metrics), grads = grad_fn(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    buffers = state.buffers
    if "load_LE" in metrics:
      buffers = update_router_biases(cfg, graphdef, params, buffers, metrics["load_LE"])
    metrics["grad_norm"] = jnp.sqrt(sum(jnp.sum(g.astype(jnp.float32) ** 2)
                                       for g in jax.tree.leaves(grads)))
    metrics["lr"] = schedule(state.step)   # the rate this step's update used
    return TrainState(params, buffers, opt_state, state.step + 1, state.rng), metrics

  return train_step


def make_eval_step(cfg: Config, graphdef):
  def eval_step(params, buffers, inputs_BT, targets_BT):
    """Summed NLL (nats) and token count over a batch."""
    model = nnx.merge(graphdef, params, buffers)
    logits, _, _ = model(inputs_BT)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets_BT)
    return nll.sum(), jnp.asarray(nll.size, jnp.float32)

  return eval_step
