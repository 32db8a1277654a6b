import json

import chex
import jax
import numpy as np
import pytest
from jax._src.array import ArrayImpl

from moejax import checkpoint, cli, state as state_mod, train as train_mod
from moejax.checkpoint import Checkpointer
from moejax.config import load_config
from moejax.inference import Engine, load_trained
from moejax.state import init_state

SMALL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
         "model.head_dim=16", "model.ffn_hidden=48", "moe.expert_hidden=32", "moe.num_experts=4",
         "model.max_seq_len=64", "data.seq_len=16", "data.batch_size=4", "train.log_every=2",
         "train.eval_every=3", "train.eval_batches=2", "train.checkpoint_every=3",
         "train.warmup_steps=2", "train.tensorboard=false"]


@pytest.fixture
def corpus(tmp_path):
  rng = np.random.default_rng(0)
  words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis"]
  text = "\n".join(" ".join(rng.choice(words, 12)) for _ in range(400))
  (tmp_path / "a.txt").write_text(text)
  return str(tmp_path / "a.txt")


def cfg_for(corpus, out_dir, *extra):
  return load_config(None, SMALL + [f"data.corpus=files", f"data.files={corpus}",
                                    f"train.out_dir={out_dir}"] + list(extra))


def _params(run_dir):
  cfg = load_config(str(run_dir / "config.yaml"))
  _, template = init_state(cfg)
  state, _ = Checkpointer(run_dir / "checkpoints").restore(template, cfg)
  return state


def test_resume_equals_uninterrupted_run(corpus, tmp_path):
  full = cfg_for(corpus, tmp_path / "full", "train.steps=6", "moe.bias_balancing=true")
  train_mod.train(full, quiet=True)
  # Same run stopped at step 3, then resumed to 6 (as a new process would).
  part = cfg_for(corpus, tmp_path / "part", "train.steps=3", "moe.bias_balancing=true")
  train_mod.train(part, quiet=True)
  resumed = cfg_for(corpus, tmp_path / "part", "train.steps=6", "moe.bias_balancing=true")
  summary = train_mod.train(resumed, quiet=True)
  assert summary["step"] == 6
  a, b = _params(tmp_path / "full"), _params(tmp_path / "part")
  assert int(a.step) == int(b.step) == 6
  chex.assert_trees_all_close(a, b, rtol=1e-6, atol=1e-7)
  # The router biases moved (aux-loss-free balancing is live) and were restored too.
  assert any(np.abs(np.asarray(v)).sum() > 0 for v in jax.tree.leaves(a.buffers))
  run = tmp_path / "full"
  assert (run / "losses.png").is_file() and (run / "expert_load.png").is_file()
  records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
  train_recs = [r for r in records if "loss" in r]
  assert {"max_vio", "expert_share", "dropped_frac", "tokens_per_s"} <= set(train_recs[-1])
  assert any("val_bpb" in r for r in records)


# log_every=4: the NaN of step 5 is found at the step-6 checkpoint, before it is written.
@pytest.mark.parametrize("log_every", [2, 4])
def test_nan_loss_stops_and_keeps_last_good_checkpoint(corpus, tmp_path, monkeypatch, log_every):
  cfg = cfg_for(corpus, tmp_path / "nan", "train.steps=8", f"train.log_every={log_every}")
  real_step = train_mod.make_train_step

  def make_step(cfg, graphdef):
    step = real_step(cfg, graphdef)

    def wrapped(state, x, y):
      state, m = step(state, x, y)
      # From step 5 on the loss reads NaN, as a diverged run's would.
      m["loss"] = m["loss"] * jax.numpy.where(state.step >= 5, jax.numpy.nan, 1.0)
      return state, m
    return wrapped

  monkeypatch.setattr(train_mod, "make_train_step", make_step)
  with pytest.raises(train_mod.NonFiniteLossError, match="step 5"):
    train_mod.train(cfg, quiet=True)
  assert Checkpointer(tmp_path / "nan" / "checkpoints").latest_step() == 3


def test_metrics_reach_the_host_only_at_log_eval_and_checkpoint_steps(corpus, tmp_path,
                                                                      monkeypatch):
  """The loop does not wait for each step: no metric array of the step is read on the host
  (float(), np.asarray, jax.device_get all go through ArrayImpl._value) until a log / eval /
  checkpoint step, and then all pending steps come in one jax.device_get."""
  cfg = cfg_for(corpus, tmp_path / "sync", "train.steps=8", "train.log_every=4",
                "train.eval_every=8", "train.checkpoint_every=8")
  produced = {}            # id(metric array) -> (array, step that returned it)
  reads = []               # (step that returned the array, steps run when it was read)
  steps_run = [0]
  real_value = ArrayImpl._value

  def value(self):
    if id(self) in produced and produced[id(self)][0] is self:
      reads.append((produced[id(self)][1], steps_run[0]))
    return real_value.fget(self)

  real_jit = train_mod.parallel.jit_train_step

  def jit_train_step(*args, **kwargs):
    step_fn = real_jit(*args, **kwargs)

    def counted(state, x, y):
      state, m = step_fn(state, x, y)
      steps_run[0] += 1
      for v in jax.tree.leaves(m):
        produced[id(v)] = (v, steps_run[0])   # keeps v alive, so ids are not reused
      return state, m
    return counted

  fetches = []
  real_get = jax.device_get
  monkeypatch.setattr(jax, "device_get", lambda x: fetches.append(steps_run[0]) or real_get(x))
  monkeypatch.setattr(ArrayImpl, "_value", property(value))
  monkeypatch.setattr(train_mod.parallel, "jit_train_step", jit_train_step)
  train_mod.train(cfg, quiet=True)
  assert steps_run[0] == 8
  assert sorted({at for _, at in reads}) == [4, 8], reads   # never after steps 1-3, 5-7
  assert sorted({made for made, _ in reads}) == list(range(1, 9))  # yet every step was seen
  assert 4 in fetches and not {1, 2, 3, 5, 6, 7} & set(fetches), fetches


def test_eval_and_generate_restore_params_only(corpus, tmp_path, monkeypatch):
  """load_trained (eval, generate, calibrate, eval-ppl) restores params and router biases
  into an abstract target: the optimizer state is never built, allocated or read."""
  run = tmp_path / "po"
  train_mod.train(cfg_for(corpus, run, "train.steps=2", "moe.bias_balancing=true"), quiet=True)
  full = _params(run)
  targets = []
  real_restore = checkpoint.Checkpointer.restore

  def spy(self, template, cfg, step=None):
    targets.append(template)
    return real_restore(self, template, cfg, step)

  def no_optimizer(*args, **kwargs):
    raise AssertionError("optimizer built while loading a run for eval / generate")

  monkeypatch.setattr(checkpoint.Checkpointer, "restore", spy)
  monkeypatch.setattr(state_mod, "make_optimizer", no_optimizer)
  monkeypatch.setattr(state_mod, "init_state", no_optimizer)
  tm = load_trained(run)
  (target,) = targets
  assert target.opt_state is None and target.step is None and target.rng is None
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(target.params))
  chex.assert_trees_all_equal(tm.params, full.params)
  chex.assert_trees_all_equal(tm.buffers, full.buffers)
  assert tm.step == 2
  assert cli.main(["eval", str(run), "--max-batches", "1"]) == 0


def interrupt_at(monkeypatch, at_step: int):
  """Makes the training loop raise KeyboardInterrupt when it asks for batch ``at_step``;
  returns the real batch function (to put back for a resume)."""
  real_batch = train_mod.train_batch

  def interrupting(tokens, B, T, seed, step):
    if step == at_step:
      raise KeyboardInterrupt
    return real_batch(tokens, B, T, seed, step)

  monkeypatch.setattr(train_mod, "train_batch", interrupting)
  return real_batch


def test_ctrl_c_saves_a_checkpoint(corpus, tmp_path, monkeypatch):
  cfg = cfg_for(corpus, tmp_path / "int", "train.steps=8")
  interrupt_at(monkeypatch, 5)
  with pytest.raises(KeyboardInterrupt):
    train_mod.train(cfg, quiet=True)
  assert Checkpointer(tmp_path / "int" / "checkpoints").latest_step() == 5


def test_cli_train_eval_generate_and_errors(corpus, tmp_path, capsys):
  out = tmp_path / "cli"
  overrides = SMALL + ["data.corpus=files", f"data.files={corpus}", f"train.out_dir={out}",
                       "train.steps=3"]
  assert cli.main(["train", "configs/tiny.yaml", *overrides]) == 0
  assert cli.main(["eval", str(out), "--max-batches", "1"]) == 0
  assert '"val_bpb"' in capsys.readouterr().out
  assert cli.main(["generate", str(out), "--prompt", "to be", "--max-new-tokens", "8"]) == 0
  text = capsys.readouterr().out
  assert "to be" in text
  # Clear errors, exit code 2.
  assert cli.main(["train", "configs/tiny.yaml", "moe.topk=3"]) == 2
  assert "did you mean 'top_k'" in capsys.readouterr().err
  assert cli.main(["eval", str(tmp_path / "missing")]) == 2
  assert cli.main(["eval", str(out), "model.d_model=64"]) == 2
  assert "does not match the config" in capsys.readouterr().err


def test_bf16_cache_generation_reproduces_full_forward(corpus, tmp_path):
  cfg = cfg_for(corpus, tmp_path / "gen", "train.steps=2", "model.dtype=float32")
  train_mod.train(cfg, quiet=True)
  tm = load_trained(tmp_path / "gen")
  prompt = [5, 9, 30, 7]
  (new,), caches = Engine.from_trained(tm).generate([prompt], 10)   # greedy by default
  ids = np.array([prompt + new], np.int32)
  # Greedy decoding through the cache must equal argmax of the full forward pass.
  logits, _, _ = tm.module()(ids[:, :-1])
  np.testing.assert_array_equal(np.asarray(logits.argmax(-1))[:, 3:], ids[:, 4:])
  assert sum(c.nbytes for c in caches) > 0


def test_cli_calibrate_eval_ppl_and_quantized_generate(corpus, tmp_path, capsys):
  out = tmp_path / "kv"
  overrides = SMALL + ["data.corpus=files", f"data.files={corpus}", f"train.out_dir={out}",
                       "train.steps=2", "data.seq_len=48", "kv_cache.group_size=16",
                       "kv_cache.residual_window=16"]
  assert cli.main(["train", "configs/tiny.yaml", *overrides]) == 0
  assert cli.main(["calibrate", str(out), "--batches", "1"]) == 0
  assert (out / "kv_outliers.npz").is_file()
  capsys.readouterr()
  assert cli.main(["eval-ppl", str(out), "--kv", "16", "2", "--outliers", "0", "0.1",
                   "--max-batches", "1"]) == 0
  table = capsys.readouterr().out
  assert "bf16" in table and "2-bit +10% fp16 ch" in table
  rows = json.loads((out / "kv_sweep_kv16-2_out0-0.1_b1.json").read_text())["rows"]
  assert [r["bits"] for r in rows] == [16, 2, 2]
  assert rows[1]["kv_bytes_4k"] < rows[0]["kv_bytes_4k"] / 4
  assert (out / "kv_sweep_kv16-2_out0-0.1_b1.png").is_file()
  assert cli.main(["generate", str(out), "--prompt", "to be or", "--max-new-tokens", "3",
                   "--kv-bits", "2", "--kv-outliers", "0.1"]) == 0
  assert "2-bit" in capsys.readouterr().err
  assert cli.main(["eval-ppl", str(out), "--kv", "5"]) == 2
  assert cli.main(["eval-ppl", str(out), "--outliers", "1.0"]) == 2
