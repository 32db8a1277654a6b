"""Training loop: jitted step, progress bar, JSONL metrics, orbax checkpoints, plots.

A resumed run continues exactly as an uninterrupted one: batch i depends only on
(seed, i), and params, optimizer state, router biases, step and RNG are restored.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from moejax import parallel, plots
from moejax.checkpoint import Checkpointer
from moejax.config import Config, save_config
from moejax.data import train_batch
from moejax.evaluate import evaluate
from moejax.run_io import load_data
from moejax.state import build_model, init_state, make_eval_step, make_train_step
from moejax.model.transformer import active_params, count_params


class NonFiniteLossError(RuntimeError):
  """Training stopped on a NaN/inf loss; the last good checkpoint is kept."""


def _load_stats(load_LE: np.ndarray, dropped_L: np.ndarray) -> dict:
  """Per-layer share of assignments per expert, MaxVio = (max - mean) / mean, dropped share."""
  share = load_LE / np.maximum(load_LE.sum(-1, keepdims=True), 1e-9)
  mean = load_LE.mean(-1)
  return {"expert_share": share.round(4).tolist(),
          "max_vio": ((load_LE.max(-1) - mean) / np.maximum(mean, 1e-9)).round(4).tolist(),
          "dropped_frac": np.asarray(dropped_L).round(4).tolist()}


class _Writers:
  """metrics.jsonl always; TensorBoard event files when tensorboardX is installed."""

  def __init__(self, out_dir: Path, tensorboard: bool):
    # On several hosts only process 0 writes logs (orbax coordinates checkpoints itself).
    self.main = jax.process_index() == 0
    self.jsonl = open(out_dir / "metrics.jsonl", "a") if self.main else None
    self.tb = None
    if tensorboard and self.main:
      try:
        from tensorboardX import SummaryWriter
        self.tb = SummaryWriter(str(out_dir / "tb"))
      except ImportError:
        pass

  def write(self, record: dict):
    if not self.main:
      return
    self.jsonl.write(json.dumps(record) + "\n")
    self.jsonl.flush()
    if self.tb is not None:
      for k, v in record.items():
        if isinstance(v, (int, float)) and k != "step":
          self.tb.add_scalar(k, v, record["step"])

  def close(self):
    if self.jsonl is not None:
      self.jsonl.close()
    if self.tb is not None:
      self.tb.close()


def _read_history(path: Path, upto: int) -> tuple[list, list]:
  """(train, val) loss curves from metrics.jsonl, ignoring records past `upto`
  (left by a run that stopped after its last checkpoint)."""
  train, val = {}, {}
  if path.is_file():
    for line in path.read_text().splitlines():
      r = json.loads(line)
      if r["step"] > upto:
        continue
      if "loss" in r:
        train[r["step"]] = r["loss"]
      if "val_loss" in r:
        val[r["step"]] = r["val_loss"]
  return sorted(train.items()), sorted(val.items())


def train(cfg: Config, *, quiet: bool = False) -> dict:
  """Trains (resuming from cfg.train.out_dir/checkpoints if present). Returns a summary."""
  t = cfg.train
  parallel.maybe_initialize_distributed()
  mesh = parallel.mesh_for_config(cfg)   # None on one device: the plain single-device path
  rules = parallel.FSDP_RULES if cfg.mesh.fsdp else None
  out_dir = Path(t.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  save_config(cfg, out_dir / "config.yaml")
  data = load_data(cfg, out_dir)
  if data.tokenizer.vocab_size > cfg.model.vocab_size:
    raise ValueError(f"tokenizer has {data.tokenizer.vocab_size} tokens, "
                     f"model.vocab_size is {cfg.model.vocab_size}")

  model = build_model(cfg, t.seed)
  n_params, n_active = count_params(model), active_params(cfg)
  graphdef, state = init_state(cfg, model)
  state = parallel.place_state(mesh, state, rules)   # restore below reads into these shardings
  moe_layers = model.moe_layers
  del model
  ckpt = Checkpointer(out_dir / "checkpoints", keep=t.keep_checkpoints)
  start = 0
  if ckpt.latest_step() is not None:
    state, _ = ckpt.restore(state, cfg)
    start = int(state.step)
    if not quiet:
      print(f"resumed from {ckpt.directory}/{start}")

  step_fn = parallel.jit_train_step(mesh, make_train_step(cfg, graphdef), state, rules)
  eval_fn = parallel.jit_eval_step(mesh, make_eval_step(cfg, graphdef), state.params,
                                   state.buffers, rules)
  if mesh is not None and not quiet:
    print("mesh: " + " ".join(f"{a}={n}" for a, n in mesh.shape.items())
          + f" over {mesh.size} {jax.default_backend()} devices")
  B, T = cfg.data.batch_size, cfg.data.seq_len
  writers = _Writers(out_dir, t.tensorboard)
  load_sum = np.zeros((len(moe_layers), cfg.moe.num_experts))
  run_load = np.zeros_like(load_sum)
  dropped_sum = np.zeros(len(moe_layers))
  interval_steps = 0  # steps accumulated in load_sum / dropped_sum since the last log record
  last_eval: dict = {}
  step = start
  tokens_done, t0 = 0, None
  pbar = tqdm(total=t.steps, initial=start, disable=quiet, desc="train", dynamic_ncols=True)

  def save(wait=False):
    ckpt.save(step, state, cfg, {"data_step": step}, wait=wait)

  try:
    while step < t.steps:
      inputs, targets = train_batch(data.train, B, T, t.seed, step)
      state, m = step_fn(state, inputs, targets)
      loss = float(m["loss"])
      step += 1
      if not math.isfinite(loss):
        raise NonFiniteLossError(
            f"loss became {loss} at step {step}; stopped without saving. The last good "
            f"checkpoint is step {ckpt.latest_step()} in {ckpt.directory}")
      if t0 is None:  # first step includes compilation: start the clock after it
        t0 = time.perf_counter()
      else:
        tokens_done += B * T
      if "load_LE" in m:
        load = np.asarray(m["load_LE"])
        load_sum += load
        run_load += load
        dropped_sum += np.asarray(m["dropped_L"])
        interval_steps += 1
      if step % t.log_every == 0 or step == t.steps:
        elapsed = time.perf_counter() - t0 if t0 else 0.0
        record = {"step": step, "loss": loss, "aux_loss": float(m["aux_loss"]),
                  "z_loss": float(m["z_loss"]), "grad_norm": float(m["grad_norm"]),
                  "lr": float(m["lr"]), "tokens_per_s": tokens_done / elapsed if elapsed else 0.0}
        if moe_layers:
          record.update(_load_stats(load_sum, dropped_sum / max(interval_steps, 1)))
          record["experts_per_token"] = float(m["experts_per_token"])
          load_sum[:] = 0
          dropped_sum[:] = 0
          interval_steps = 0
        writers.write(record)
        pbar.set_postfix(loss=f"{loss:.3f}", aux=f"{record['aux_loss']:.3f}",
                         tok_s=f"{record['tokens_per_s']:.0f}")
      if step % t.eval_every == 0 or step == t.steps:
        last_eval = evaluate(eval_fn, state.params, state.buffers, data, B, T, t.eval_batches)
        writers.write({"step": step, **last_eval})
        if not quiet:
          pbar.write(f"step {step}: val loss {last_eval['val_loss']:.4f} "
                     f"bpb {last_eval['val_bpb']:.4f}")
      if step % t.checkpoint_every == 0 or step == t.steps:
        save()
      pbar.update(1)
  except KeyboardInterrupt:
    if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state)):
      print(f"\ninterrupted mid-step; kept checkpoint {ckpt.latest_step()}")
    else:
      save(wait=True)
      print(f"\ninterrupted: saved checkpoint at step {step} in {ckpt.directory}")
    raise
  finally:
    pbar.close()
    writers.close()
    ckpt.wait()

  elapsed = time.perf_counter() - t0 if t0 else 0.0
  train_curve, val_curve = _read_history(out_dir / "metrics.jsonl", step)
  paths = [str(plots.plot_losses(train_curve, val_curve, out_dir / "losses.png"))]
  if moe_layers and run_load.sum() > 0:
    share = run_load / run_load.sum(-1, keepdims=True)
    paths.append(str(plots.plot_expert_load(share, moe_layers, out_dir / "expert_load.png")))
  summary = {"step": step, "params": n_params, "active_params": n_active,
             "tokens_per_s": tokens_done / elapsed if elapsed else 0.0,
             "train_loss": train_curve[-1][1] if train_curve else float("nan"),
             **last_eval, "plots": paths, "run_dir": str(out_dir),
             "mesh": dict(mesh.shape) if mesh is not None else None}
  (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
  ckpt.close()
  return summary
