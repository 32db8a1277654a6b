"""`moejax eval-routing` (issue 36) end to end on a tiny trained top-2 run, and its refusals,
each of which writes nothing."""
import json
import shutil
from pathlib import Path

import jax
import pytest

import _tiny_run as tiny_run

from moejax import cli
from moejax.config import load_config
from moejax.inference import elastic

SMALL = tiny_run.small(layers=3, steps=6, max_seq_len=128)
_cfg = lambda tmp, run, *extra: tiny_run.config(tmp, SMALL, run, *extra)
_tree = tiny_run.tree


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """A tiny run trained 6 steps, and one with no MoE layer (checkpointed, not trained)."""
  return tiny_run.make_runs(tmp_path_factory.mktemp("elastic"), SMALL)


@pytest.fixture
def run(runs, tmp_path):
  """A private copy of the trained run (tests write into it)."""
  return tiny_run.private_copy(runs, tmp_path)


def test_eval_routing_writes_the_sweep(run, capsys):
  assert cli.main(["eval-routing", str(run), "--top-p", "0.3", "0.9", "--entropy", "0.0", "0.9",
                   "--max-k", "3", "--batches", "2"]) == 0
  out = capsys.readouterr().out
  result = json.loads((run / elastic.SWEEP_FILE).read_text())
  rows = result["rows"]
  assert [r["setting"] for r in rows] == ["trained", "top_p=0.3", "top_p=0.9", "entropy=0",
                                          "entropy=0.9"]
  assert (result["max_k"], result["min_k"], result["moe_layers"]) == (3, 1, [1, 2])
  assert result["trained"] == {"routing": "softmax_topk", "top_k": 2, "renormalize": True,
                               "num_experts": 4}
  base = rows[0]
  assert base["delta_ppl_pct"] == 0.0 and base["experts_per_token"] == 2.0
  assert base["val_tokens"] == result["val_tokens"] == 2 * 4 * 16
  for r in rows[1:]:
    assert 1.0 <= r["experts_per_token"] <= 3.0
    assert len(r["experts_per_token_L"]) == 2
    assert r["delta_ppl_pct"] == pytest.approx(100 * (r["ppl"] / base["ppl"] - 1))
  by = {r["setting"]: r["experts_per_token"] for r in rows}
  assert by["top_p=0.3"] < by["top_p=0.9"]          # a higher p takes more experts
  assert by["entropy=0"] == 3.0                      # h > 0 for every token: max_k
  assert by["entropy=0.9"] <= 3.0
  for name in ("trained", "top_p", "entropy", "experts/token", "Δppl %", str(run)):
    assert name in out


def test_the_baseline_is_moejax_eval_and_the_trained_k_changes_nothing(run):
  """The baseline's perplexity is `moejax eval`'s on the same batches; entropy routing with
  min_k = max_k = top_k is the trained routing (same weights, same perplexity)."""
  from moejax.evaluate import evaluate
  from moejax.inference.load import load_trained
  from moejax.run_io import load_data
  from moejax.state import make_eval_step
  result, _ = elastic.run_sweep(run, top_p=[], entropy=[0.5], min_k=2, max_k=2, batches=3,
                                quiet=True)
  tm = load_trained(run)
  d = tm.cfg.data
  want = evaluate(jax.jit(make_eval_step(tm.cfg, tm.graphdef)), tm.params, tm.buffers,
                  load_data(tm.cfg, run), d.batch_size, d.seq_len, 3)
  base, same_k = result["rows"]
  assert base["ppl"] == pytest.approx(want["val_ppl"], rel=1e-6)
  assert same_k["experts_per_token"] == 2.0
  assert same_k["ppl"] == pytest.approx(base["ppl"], rel=1e-5)


def test_eval_routing_times_decode(run, capsys):
  assert cli.main(["eval-routing", str(run), "--top-p", "0.5", "--entropy", "--batches", "1",
                   "--time"]) == 0
  rows = json.loads((run / elastic.SWEEP_FILE).read_text())["rows"]
  assert [r["setting"] for r in rows] == ["trained", "top_p=0.5"]
  for r in rows:
    assert r["ms_per_token"] > 0
  assert rows[0]["decode_experts_per_layer"] == 2.0      # batch 1: top-2 reads 2 experts
  assert 1.0 <= rows[1]["decode_experts_per_layer"] <= 2.0
  assert "ms/token" in capsys.readouterr().out


def test_topk_softmax_runs_decode_with_renormalized_weights():
  trained = load_config(None, ["moe.routing=topk_softmax", "moe.renormalize=false"])
  s = elastic.Setting("entropy", 0.4)
  assert elastic.setting_overrides(trained, s, 3, 1) == [
      "moe.routing=entropy", "moe.max_k=3", "moe.entropy_threshold=0.4", "moe.min_k=1",
      "moe.renormalize=true"]
  softmax_topk = load_config(None, ["moe.renormalize=false"])
  assert elastic.setting_overrides(softmax_topk, elastic.Setting("top_p", 0.7), 2, 1) == [
      "moe.routing=top_p", "moe.max_k=2", "moe.top_p=0.7"]     # trained weights kept as-is
  assert elastic.setting_overrides(softmax_topk, elastic.Setting("trained", None), 2, 1) == []


@pytest.mark.parametrize("args, message", [
    (["--top-p", "0"], "--top-p 0: must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
    (["--entropy", "1"], "--entropy 1: must be in [0, 1)"),
    (["--max-k", "5"], "moe.max_k=5 exceeds moe.num_experts=4"),
    (["--min-k", "3"], "moe.min_k=3: must be in [1, moe.max_k=2]"),
    (["moe.routing=nope"], "must be one of softmax_topk, topk_softmax, top_p, entropy"),
])
def test_eval_routing_refuses_bad_settings_and_writes_nothing(run, capsys, args, message):
  before = _tree(run)
  assert cli.main(["eval-routing", str(run), *args]) == 2
  err = capsys.readouterr().err
  assert err.startswith("moejax eval-routing: error:") and message in err, err
  assert _tree(run) == before


def test_eval_routing_refuses_a_dense_model_and_a_missing_run(runs, tmp_path, capsys):
  dense = Path(shutil.copytree(runs / "dense", tmp_path / "dense"))
  before = _tree(dense)
  assert cli.main(["eval-routing", str(dense)]) == 2
  assert "no MoE layer" in capsys.readouterr().err
  assert _tree(dense) == before
  assert cli.main(["eval-routing", str(tmp_path / "nowhere")]) == 2
  assert "is not a run directory" in capsys.readouterr().err
  assert not (tmp_path / "nowhere").exists()
