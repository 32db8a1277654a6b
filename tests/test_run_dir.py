"""A run directory is never damaged (issue #33): refused commands write nothing, a finished
run re-run is a no-op, checkpoint labels are the stored step, metrics have one row per step,
result files are strict JSON named after their settings."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moejax import cli, demo, train as train_mod
from moejax.checkpoint import Checkpointer
from moejax.state import init_state
from test_train import SMALL, cfg_for, corpus, interrupt_at  # noqa: F401  (corpus is a fixture)

REPO = Path(__file__).resolve().parents[1]


def _files(run: Path) -> dict[str, bytes]:
  """Every file of the run directory outside checkpoints/, with its bytes."""
  return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
          if p.is_file() and "checkpoints" not in p.parts}


def _strict_json(text: str):
  def refuse(name):
    raise ValueError(f"not JSON: {name}")
  return json.loads(text, parse_constant=refuse)


def _steps(run: Path) -> list[int]:
  return [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()]


def _logged_past(run: Path, step: int) -> bool:
  try:
    return _steps(run)[-1] > step
  except (FileNotFoundError, IndexError, ValueError):   # not yet written, or a line half-written
    return False


def _train_args(corpus, run, *extra):
  return ["train", "configs/tiny.yaml", *SMALL, "data.corpus=files", f"data.files={corpus}",
          f"train.out_dir={run}", *extra]


def test_second_demo_run_keeps_summary_and_exits_0(corpus, tmp_path, capsys):
  run = tmp_path / "demo"
  args = ["--config", "configs/tiny.yaml", *SMALL, "model.max_seq_len=256", "data.corpus=files",
          f"data.files={corpus}", f"train.out_dir={run}", "train.steps=3"]
  assert demo.main(args) == 0
  first = _files(run)
  assert "val_loss" in _strict_json(first["summary.json"].decode())
  capsys.readouterr()
  assert demo.main(args) == 0
  out = capsys.readouterr().out
  assert "already trained to step 3" in out and "val tokens" in out
  again = _files(run)
  for name in ("summary.json", "config.yaml", "metrics.jsonl"):
    assert again[name] == first[name], name


def test_refused_commands_leave_config_yaml_byte_identical(corpus, tmp_path, capsys):
  run = tmp_path / "run"
  assert cli.main(_train_args(corpus, run, "train.steps=3")) == 0
  before = _files(run)
  # A resume refused for a changed model size, and a corpus glob that matches nothing.
  assert cli.main(_train_args(corpus, run, "train.steps=6", "model.d_model=64")) == 2
  assert "does not match the config" in capsys.readouterr().err
  assert cli.main(_train_args(tmp_path / "none*.txt", run, "train.steps=6")) == 2
  assert _files(run) == before
  # The saved config still trains (here: a no-op, the run is finished) and extends.
  assert cli.main(["train", str(run / "config.yaml")]) == 0
  assert "nothing to do" in capsys.readouterr().out
  assert _files(run) == before
  assert cli.main(["train", str(run / "config.yaml"), "train.steps=6"]) == 0
  assert _strict_json((run / "summary.json").read_text())["step"] == 6


def test_ctrl_c_checkpoint_label_is_its_step_and_resume_names_it(corpus, tmp_path, capsys,
                                                                 monkeypatch):
  run = tmp_path / "int"
  real_batch = interrupt_at(monkeypatch, 5)
  with pytest.raises(KeyboardInterrupt):
    train_mod.train(cfg_for(corpus, run, "train.steps=8"))
  assert f"saved checkpoint at step 5 in {run.absolute()}/checkpoints/5" in capsys.readouterr().out
  assert Checkpointer(run / "checkpoints").read_meta(5)["step"] == 5
  monkeypatch.setattr(train_mod, "train_batch", real_batch)
  train_mod.train(cfg_for(corpus, run, "train.steps=8"))
  out = capsys.readouterr().out
  assert f"resumed from {run.absolute()}/checkpoints/5\n" in out
  assert _steps(run) == [2, 3, 4, 6, 8]


def test_resume_names_the_existing_checkpoint_when_its_label_differs(corpus, tmp_path, capsys):
  """Checkpoints written by the old Ctrl-C path (label one below the stored step) resume
  from the directory that exists, and say at which step."""
  run = tmp_path / "old"
  cfg = cfg_for(corpus, run, "train.steps=4")
  train_mod.train(cfg_for(corpus, run, "train.steps=3"), quiet=True)
  _, template = init_state(cfg)
  ckpt = Checkpointer(run / "checkpoints")
  state, _ = ckpt.restore(template, cfg)
  for step in ckpt.manager.all_steps():
    ckpt.manager.delete(step)
  ckpt.save(2, state, cfg, wait=True)   # state.step is 3
  ckpt.close()
  capsys.readouterr()
  train_mod.train(cfg)
  out = capsys.readouterr().out
  assert f"resumed from {run.absolute()}/checkpoints/2 (its state is at step 3)" in out
  assert (run / "checkpoints" / "2").is_dir()


def test_kill_9_then_resume_gives_one_metrics_row_per_step(corpus, tmp_path):
  run = tmp_path / "killed"
  args = _train_args(corpus, run, "train.steps=100000", "train.log_every=1",
                     "train.checkpoint_every=3", "train.eval_every=3")
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.Popen([sys.executable, "-m", "moejax.cli", *args], cwd=REPO, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.monotonic() + 50
    # Past the first checkpoint and with steps logged after it: a kill leaves rows to repeat.
    while not ((run / "checkpoints" / "3").is_dir() and _logged_past(run, 4)):
      assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint in time"
      time.sleep(0.2)
  finally:
    proc.kill()
    proc.wait()
  latest = Checkpointer(run / "checkpoints").latest_step()
  assert _steps(run)[-1] > latest
  assert cli.main([*args, f"train.steps={latest + 3}"]) == 0
  assert _strict_json((run / "summary.json").read_text())["step"] == latest + 3
  assert _steps(run) == list(range(1, latest + 4))


def test_nan_before_any_checkpoint_says_so(corpus, tmp_path, monkeypatch):
  real_step = train_mod.make_train_step

  def make_step(cfg, graphdef):
    step = real_step(cfg, graphdef)
    return lambda state, x, y: (lambda s, m: (s, {**m, "loss": m["loss"] * np.nan}))(
        *step(state, x, y))

  monkeypatch.setattr(train_mod, "make_train_step", make_step)
  with pytest.raises(train_mod.NonFiniteLossError, match="No checkpoint had been written yet"):
    train_mod.train(cfg_for(corpus, tmp_path / "nan", "train.steps=4"), quiet=True)


def test_tensorboard_writes_event_files(corpus, tmp_path):
  pytest.importorskip("tensorboardX")   # the `test` extra installs it
  train_mod.train(cfg_for(corpus, tmp_path / "tb", "train.steps=2", "train.log_every=1",
                          "train.tensorboard=true"), quiet=True)
  events = list((tmp_path / "tb" / "tb").glob("events.out.tfevents.*"))
  assert len(events) == 1 and events[0].stat().st_size > 0


def test_tensorboard_without_tensorboardx_says_why(corpus, tmp_path, capsys, monkeypatch):
  monkeypatch.setitem(sys.modules, "tensorboardX", None)   # import raises ImportError
  train_mod.train(cfg_for(corpus, tmp_path / "tb", "train.steps=1", "train.tensorboard=true"),
                  quiet=True)
  assert "tensorboardX is not installed" in capsys.readouterr().err


def test_sweeps_are_strict_json_named_after_settings_and_take_overrides(corpus, tmp_path, capsys):
  run = tmp_path / "kv"
  assert cli.main(_train_args(corpus, run, "train.steps=2", "data.seq_len=48",
                              "kv_cache.group_size=16", "kv_cache.residual_window=16")) == 0
  capsys.readouterr()
  # No 16 in --kv: no bf16 baseline, so Δ is null (was NaN, which is not JSON).
  assert cli.main(["eval-ppl", str(run), "--kv", "2", "--outliers", "0", "--max-batches", "1"]) == 0
  out = capsys.readouterr().out
  assert "n/a" in out and "validation tokens" in out
  first = run / "kv_sweep_kv2_out0_b1.json"
  doc = _strict_json(first.read_text())
  assert doc["rows"][0]["delta_ppl_pct"] is None and doc["rows"][0]["val_tokens"] > 0
  # Other settings (and an override, which eval-ppl now takes) write other files.
  assert cli.main(["eval-ppl", str(run), "kv_cache.residual_window=32", "--kv", "16", "2",
                   "--outliers", "0", "--max-batches", "1"]) == 0
  second = run / "kv_sweep_kv16-2_out0_b1_kv_cache.residual_window-32.json"
  assert _strict_json(second.read_text())["overrides"] == ["kv_cache.residual_window=32"]
  assert _strict_json(first.read_text()) == doc
  assert cli.main(["generate", str(run), "kv_cache.group_size=16", "--prompt", "to",
                   "--max-new-tokens", "2"]) == 0
  for bad in (["--max-batches", "0"], ["--max-batches", "-3"]):
    with pytest.raises(SystemExit) as exit_:
      cli.main(["eval-ppl", str(run), *bad])
    assert exit_.value.code == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_eval_notes_an_edited_config_yaml(corpus, tmp_path, capsys):
  run = tmp_path / "edit"
  train_mod.train(cfg_for(corpus, run, "train.steps=1"), quiet=True)
  path = run / "config.yaml"
  path.write_text(path.read_text().replace("top_k: 2", "top_k: 1"))
  capsys.readouterr()
  assert cli.main(["eval", str(run), "--max-batches", "1"]) == 0
  captured = capsys.readouterr()
  assert "differs from the checkpoint's config in moe.top_k" in captured.err
  assert '"val_tokens": 64' in captured.out
