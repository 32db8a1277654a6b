import json

import jax
import numpy as np
import pytest

from moejax import cli, train as train_mod
from moejax.checkpoint import Checkpointer
from moejax.config import load_config
from moejax.generate import generate, load_trained
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
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
  # The router biases moved (aux-loss-free balancing is live) and were restored too.
  assert any(np.abs(np.asarray(v)).sum() > 0 for v in jax.tree.leaves(a.buffers))
  run = tmp_path / "full"
  assert (run / "losses.png").is_file() and (run / "expert_load.png").is_file()
  records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
  train_recs = [r for r in records if "loss" in r]
  assert {"max_vio", "expert_share", "dropped_frac", "tokens_per_s"} <= set(train_recs[-1])
  assert any("val_bpb" in r for r in records)


def test_nan_loss_stops_and_keeps_last_good_checkpoint(corpus, tmp_path, monkeypatch):
  cfg = cfg_for(corpus, tmp_path / "nan", "train.steps=8")
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


def test_ctrl_c_saves_a_checkpoint(corpus, tmp_path, monkeypatch):
  cfg = cfg_for(corpus, tmp_path / "int", "train.steps=8")
  real_batch = train_mod.train_batch

  def interrupting(tokens, B, T, seed, step):
    if step == 5:
      raise KeyboardInterrupt
    return real_batch(tokens, B, T, seed, step)

  monkeypatch.setattr(train_mod, "train_batch", interrupting)
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
  prompt = np.array([[5, 9, 30, 7]], np.int32)
  ids, caches = generate(tm, prompt, 10, temperature=0.0)
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
  rows = json.loads((out / "kv_sweep.json").read_text())
  assert [r["bits"] for r in rows] == [16, 2, 2]
  assert rows[1]["kv_bytes_4k"] < rows[0]["kv_bytes_4k"] / 4
  assert (out / "ppl_vs_bits.png").is_file()
  assert cli.main(["generate", str(out), "--prompt", "to be or", "--max-new-tokens", "3",
                   "--kv-bits", "2", "--kv-outliers", "0.1"]) == 0
  assert "2-bit" in capsys.readouterr().err
  assert cli.main(["eval-ppl", str(out), "--kv", "5"]) == 2
  assert cli.main(["eval-ppl", str(out), "--outliers", "1.0"]) == 2
