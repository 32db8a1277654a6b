"""Training loop: jitted step, progress bar, JSONL metrics, orbax checkpoints, plots.

A resumed run continues exactly as an uninterrupted one: batch i depends only on
(seed, i), and params, optimizer state, router biases, step and RNG are restored.

The loop never waits for a step's result: metrics stay on device and reach the host in one
transfer at log, eval and checkpoint steps (and on Ctrl-C), where a NaN/inf loss of any
step since the last fetch stops the run before anything is evaluated or saved.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from moejax import parallel, plots
from moejax.checkpoint import Checkpointer
from moejax.atomic import write_atomic
from moejax.config import Config, save_config
from moejax.data import train_batch
from moejax.evaluate import evaluate
from moejax.run_io import load_data
from moejax.state import (build_model, check_trainable, init_state, make_eval_step,
                          make_train_step)
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
        print("train.tensorboard=true but tensorboardX is not installed: no TensorBoard event "
              "files (pip install tensorboardX, or set train.tensorboard=false)", file=sys.stderr)

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


class _PendingMetrics:
  """The steps' metrics since the last fetch (on device) and the load sums fetched so far."""

  def __init__(self, num_moe_layers: int, num_experts: int):
    self.pending: list[tuple[int, dict]] = []      # (step, metrics on device)
    self.load_sum = np.zeros((num_moe_layers, num_experts))   # since the last log record
    self.dropped_sum = np.zeros(num_moe_layers)
    self.interval_steps = 0
    self.run_load = np.zeros_like(self.load_sum)   # whole run, for the plot
    self.last: dict = {}                           # host metrics of the latest fetched step

  def add(self, step: int, metrics: dict):
    self.pending.append((step, metrics))

  def fetch(self) -> tuple[int, float] | None:
    """One device->host transfer of every pending step. -> (step, loss) of the first
    non-finite loss (later steps are not counted), or None."""
    steps = [s for s, _ in self.pending]
    host = jax.device_get([m for _, m in self.pending])
    self.pending.clear()
    for step, m in zip(steps, host):
      loss = float(m["loss"])
      if not math.isfinite(loss):
        return step, loss
      if "load_LE" in m:
        self.load_sum += m["load_LE"]
        self.run_load += m["load_LE"]
        self.dropped_sum += m["dropped_L"]
        self.interval_steps += 1
      self.last = m
    return None

  def interval_load_stats(self) -> dict:
    """_load_stats over the steps since the last call, then starts a new interval."""
    out = _load_stats(self.load_sum, self.dropped_sum / max(self.interval_steps, 1))
    self.load_sum[:] = 0
    self.dropped_sum[:] = 0
    self.interval_steps = 0
    return out


def _truncate_metrics(path: Path, upto: int) -> None:
  """Drops metrics.jsonl rows past `upto`: a run killed after its last checkpoint logged steps
  that the resumed run repeats, and each step must have one row."""
  if not path.is_file():
    return
  lines = path.read_text().splitlines(keepends=True)
  keep = []
  for line in lines:
    try:
      if json.loads(line)["step"] <= upto:
        keep.append(line if line.endswith("\n") else line + "\n")
    except (ValueError, KeyError, TypeError):
      pass   # a line cut short by a kill
  if keep != lines:
    write_atomic(path, "".join(keep))


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
  check_trainable(cfg)   # before anything is built or written
  parallel.maybe_initialize_distributed()
  mesh = parallel.mesh_for_config(cfg)   # None on one device: the plain single-device path
  ep = parallel.expert_parallel(mesh, cfg.mesh.exchange)   # None without a mesh
  rules = parallel.FSDP_RULES if cfg.mesh.fsdp else None
  out_dir = Path(t.out_dir)
  # Nothing in the run directory is written until the config, data and checkpoint have all
  # been checked: a refused command leaves config.yaml, metrics and summary as they were.
  data = load_data(cfg, out_dir)
  if data.tokenizer.vocab_size > cfg.model.vocab_size:
    raise ValueError(f"tokenizer has {data.tokenizer.vocab_size} tokens, "
                     f"model.vocab_size is {cfg.model.vocab_size}")

  model = build_model(cfg, t.seed, ep)
  n_params, n_active = count_params(model), active_params(cfg)
  graphdef, state = init_state(cfg, model)
  state = parallel.place_state(mesh, state, rules)   # restore below reads into these shardings
  moe_layers = model.moe_layers
  del model
  ckpt_dir = out_dir / "checkpoints"
  ckpt = Checkpointer(ckpt_dir, keep=t.keep_checkpoints) if ckpt_dir.is_dir() else None
  latest = ckpt.latest_step() if ckpt else None
  start = 0
  if latest is not None:
    state, _ = ckpt.restore(state, cfg, latest)
    start = int(state.step)
    done = _finished(out_dir, start, t.steps, quiet) if start >= t.steps else None
    if done is not None:
      ckpt.close()
      return done
    if not quiet:
      print(f"resumed from {ckpt.directory}/{latest}"
            + (f" (its state is at step {start})" if start != latest else ""))
  out_dir.mkdir(parents=True, exist_ok=True)
  save_config(cfg, out_dir / "config.yaml")
  _truncate_metrics(out_dir / "metrics.jsonl", start)
  ckpt = ckpt or Checkpointer(ckpt_dir, keep=t.keep_checkpoints)

  step_fn = parallel.jit_train_step(mesh, make_train_step(cfg, graphdef), state, rules)
  eval_fn = parallel.jit_eval_step(mesh, make_eval_step(cfg, graphdef), state.params,
                                   state.buffers, rules)
  if mesh is not None and not quiet:
    print("mesh: " + " ".join(f"{a}={n}" for a, n in mesh.shape.items())
          + f" over {mesh.size} {jax.default_backend()} devices")
  B, T = cfg.data.batch_size, cfg.data.seq_len
  writers = _Writers(out_dir, t.tensorboard)
  metrics = _PendingMetrics(len(moe_layers), cfg.moe.num_experts)
  last_eval: dict = {}
  step = start
  tokens_done, t0 = 0, None
  pbar = tqdm(total=t.steps, initial=start, disable=quiet, desc="train", dynamic_ncols=True)

  def save(wait=False) -> int:
    # The label is the state's own step, so a checkpoint's name is the step it resumes at.
    label = int(jax.device_get(state.step))
    ckpt.save(label, state, cfg, {"data_step": label}, wait=wait)
    return label

  def fetch_or_stop():
    bad = metrics.fetch()
    if bad is not None:
      good = ckpt.latest_step()
      kept = (f"The last good checkpoint is step {good} in {ckpt.directory}" if good is not None
              else "No checkpoint had been written yet")
      raise NonFiniteLossError(
          f"loss became {bad[1]} at step {bad[0]}; stopped without saving. {kept}")

  try:
    while step < t.steps:
      inputs, targets = train_batch(data.train, B, T, t.seed, step)
      state, m = step_fn(state, inputs, targets)
      step += 1
      metrics.add(step, m)
      if t0 is None:  # the first step includes compilation: wait for it, then start the clock
        jax.block_until_ready(m)
        t0 = time.perf_counter()
      else:
        tokens_done += B * T
      final = step == t.steps
      log_now, eval_now = step % t.log_every == 0 or final, step % t.eval_every == 0 or final
      save_now = step % t.checkpoint_every == 0 or final
      if log_now or eval_now or save_now:
        fetch_or_stop()
      record = {"step": step}   # one metrics.jsonl row per step: train and eval metrics
      if log_now:
        elapsed = time.perf_counter() - t0 if t0 else 0.0
        h = metrics.last
        record |= {"loss": float(h["loss"]), "aux_loss": float(h["aux_loss"]),
                   "z_loss": float(h["z_loss"]), "grad_norm": float(h["grad_norm"]),
                   "lr": float(h["lr"]), "tokens_per_s": tokens_done / elapsed if elapsed else 0.0}
        if moe_layers:
          record.update(metrics.interval_load_stats())
          record["experts_per_token"] = float(h["experts_per_token"])
        pbar.set_postfix(loss=f"{record['loss']:.3f}", aux=f"{record['aux_loss']:.3f}",
                         tok_s=f"{record['tokens_per_s']:.0f}")
      if eval_now:
        last_eval = evaluate(eval_fn, state.params, state.buffers, data, B, T, t.eval_batches)
        record |= last_eval
        if not quiet:
          pbar.write(f"step {step}: val loss {last_eval['val_loss']:.4f} "
                     f"bpb {last_eval['val_bpb']:.4f} ({last_eval['val_tokens']:,} tokens)")
      if len(record) > 1:
        writers.write(record)
      if save_now:
        save()
      pbar.update(1)
  except KeyboardInterrupt:
    if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state)):
      print(f"\ninterrupted mid-step; kept checkpoint {ckpt.latest_step()}")
    elif metrics.fetch() is not None:   # never save a state past a non-finite loss
      print(f"\ninterrupted after a non-finite loss; kept checkpoint {ckpt.latest_step()}")
    else:
      label = save(wait=True)
      print(f"\ninterrupted: saved checkpoint at step {label} in {ckpt.directory}/{label}")
    raise
  finally:
    pbar.close()
    writers.close()
    ckpt.wait()

  if not last_eval:   # nothing trained (see _finished): the summary still has val metrics
    last_eval = evaluate(eval_fn, state.params, state.buffers, data, B, T, t.eval_batches)
  elapsed = time.perf_counter() - t0 if t0 else 0.0
  train_curve, val_curve = _read_history(out_dir / "metrics.jsonl", step)
  paths = [str(plots.plot_losses(train_curve, val_curve, out_dir / "losses.png"))]
  run_load = metrics.run_load
  if moe_layers and run_load.sum() > 0:
    share = run_load / run_load.sum(-1, keepdims=True)
    paths.append(str(plots.plot_expert_load(share, moe_layers, out_dir / "expert_load.png")))
  summary = {"step": step, "params": n_params, "active_params": n_active,
             "tokens_per_s": tokens_done / elapsed if elapsed else 0.0,
             "train_loss": train_curve[-1][1] if train_curve else None,
             **last_eval, "plots": paths, "run_dir": str(out_dir),
             "mesh": dict(mesh.shape) if mesh is not None else None}
  write_atomic(out_dir / "summary.json", json.dumps(summary, indent=2, allow_nan=False))
  ckpt.close()
  return summary


def _finished(out_dir: Path, at: int, steps: int, quiet: bool) -> dict | None:
  """A run already at (or past) train.steps: nothing is trained or written; the summary of
  the run is returned as saved (raise train.steps to train further)."""
  path = out_dir / "summary.json"
  if not path.is_file():
    return None   # killed between the last checkpoint and the summary: train() writes it
  summary = json.loads(path.read_text())
  if not quiet:
    print(f"{out_dir} is already trained to step {at} (train.steps={steps}): nothing to do; "
          f"raise train.steps to train further")
  return summary
