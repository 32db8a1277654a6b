"""`moejax train-predictor` and `moejax eval-prefetch` end to end on a tiny trained run, and
their refusals, each of which writes nothing."""
import json

import pytest

import _tiny_run as tiny_run

from moejax import cli, train as train_mod

SMALL = tiny_run.small(layers=4, steps=4, max_seq_len=64)
_cfg = lambda tmp, run, *extra: tiny_run.config(tmp, SMALL, run, *extra)
_tree = tiny_run.tree


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """A tiny run trained 4 steps, and one with no MoE layer (checkpointed, not trained)."""
  return tiny_run.make_runs(tmp_path_factory.mktemp("prefetch"), SMALL)


@pytest.fixture
def run(runs, tmp_path):
  """A private copy of the trained run (tests write into it)."""
  return tiny_run.private_copy(runs, tmp_path)


def test_eval_prefetch_writes_rows_plot_and_a_predictor(run, capsys):
  assert cli.main(["eval-prefetch", str(run), "--tokens", "256"]) == 0
  out, err = capsys.readouterr()
  assert "no " in err and "predictor.npz: training one" in err
  for name in ("prefetch.json", "prefetch.png", "predictor.npz", "predictor.json"):
    assert (run / name).is_file(), name
  result = json.loads((run / "prefetch.json").read_text())
  assert (result["step"], result["val_tokens"], result["train_tokens"]) == (4, 256, 256)
  assert result["lookahead"] == [1, 2, 3] and result["fetch_sizes"] == [2, 3, 4]
  next_rows = [r for r in result["rows"] if r["lookahead"] == "next"]
  rows = [r for r in result["rows"] if r["lookahead"] != "next"]
  names = {"gate", "learned", "previous", "frequency"}
  assert {r["predictor"] for r in rows} == names
  assert all(0.0 <= r["recall"] <= 1.0 for r in result["rows"])
  assert all(r["recall"] == 1.0 for r in result["rows"] if r["m"] == 4)       # m = E
  # Next-token rows: every MoE layer from itself, on the tokens with a previous one.
  assert {r["predictor"] for r in next_rows} == {"learned, next token", "previous", "frequency"}
  assert all(r["used"] == (256 - 256 // 16) * 2 * 3 for r in next_rows if r["layer"] == "all")
  overall = [r for r in rows if r["layer"] == "all"]
  assert len(overall) == 4 * 3 * 3                                   # predictors x d x m
  # Target layers: MoE layers 1-3 with a layer d above; used = 256 tokens x k.
  assert {(r["lookahead"], r["layer"]) for r in rows if r["layer"] != "all"} == {
      (1, 1), (1, 2), (1, 3), (2, 2), (2, 3), (3, 3)}
  assert all(r["used"] == 256 * 2 * (4 - r["lookahead"]) for r in overall)
  for p in names:   # recall grows with m
    for d in (1, 2, 3):
      by_m = [r["recall"] for r in overall if (r["predictor"], r["lookahead"]) == (p, d)]
      assert by_m == sorted(by_m)
  assert "recall m=2" in out and "learned" in out and str(run / "prefetch.png") in out


def test_train_predictor_then_eval_uses_it(run, capsys):
  assert cli.main(["train-predictor", str(run), "--lookahead", "1", "--tokens", "128"]) == 0
  assert "lookahead 1, 128 training tokens" in capsys.readouterr().out
  meta = json.loads((run / "predictor.json").read_text())
  assert (meta["step"], meta["lookahead"], meta["pairs"]) == (4, [1], [[0, 1], [1, 2], [2, 3]])
  stored = (run / "predictor.npz").read_bytes()
  assert cli.main(["eval-prefetch", str(run), "--lookahead", "1", "--tokens", "64"]) == 0
  assert "training one" not in capsys.readouterr().err
  assert (run / "predictor.npz").read_bytes() == stored
  result = json.loads((run / "prefetch.json").read_text())
  assert result["train_tokens"] == 128 and result["lookahead"] == [1]
  # Asking for a distance the predictor lacks is refused (and says how to retrain).
  before = _tree(run)
  assert cli.main(["eval-prefetch", str(run), "--lookahead", "1", "2", "--tokens", "64"]) == 2
  assert "--lookahead 1 2" in capsys.readouterr().err
  assert _tree(run) == before


def test_predictor_of_an_earlier_checkpoint_is_refused(runs, run, capsys):
  assert cli.main(["train-predictor", str(run), "--tokens", "64"]) == 0
  train_mod.train(_cfg(runs, "unused", f"train.out_dir={run}", "train.steps=6"), quiet=True)
  before = _tree(run)
  assert cli.main(["eval-prefetch", str(run), "--tokens", "64"]) == 2
  err = capsys.readouterr().err
  assert "another model or checkpoint (step 4" in err and "this run: step 6" in err
  assert "moejax train-predictor" in err
  assert _tree(run) == before


@pytest.mark.parametrize("command", ["eval-prefetch", "train-predictor"])
def test_refusals_write_nothing(runs, run, tmp_path, capsys, command):
  before, dense_before = _tree(run), _tree(runs / "dense")
  cases = [([str(tmp_path / "nowhere")], "is not a run directory"),
           ([str(runs / "dense")], "no MoE layer"),
           ([str(run), "--lookahead", "0"], "--lookahead 0: must be in [1, 3]"),
           ([str(run), "--lookahead", "1", "4"], "--lookahead 4: must be in [1, 3] (the model "
                                                "has 4 layers)")]
  for args, message in cases:
    assert cli.main([command, *args]) == 2, args
    assert message in capsys.readouterr().err
  with pytest.raises(SystemExit):   # argparse: --tokens must be >= 1
    cli.main([command, str(run), "--tokens", "0"])
  assert _tree(run) == before and _tree(runs / "dense") == dense_before
  assert not (tmp_path / "nowhere").exists()
