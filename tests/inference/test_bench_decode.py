"""moejax bench-decode on the CPU: byte accounting from shapes, and one smoke run through the
CLI (tiny shapes, interpret mode; the timings mean nothing here, the table and JSON do)."""
import json

import pytest

from moejax import cli
from moejax.config import load_config, with_overrides
from moejax.inference import bench_decode as bd
from moejax.state import build_model, split_model

TINY = "configs/tiny.yaml"


def test_weight_bytes_split_one_expert_from_the_rest():
  cfg = with_overrides(load_config(TINY), ["model.param_dtype=bfloat16"])
  _, params, _ = split_model(build_model(cfg, 0))
  per_expert, other, embed = bd.weight_bytes(params)
  m, e = cfg.model, cfg.moe
  moe_layers = m.num_layers - e.first_dense_layers
  assert per_expert == moe_layers * 3 * m.d_model * e.expert_hidden * 2
  assert embed == m.vocab_size * m.d_model * 2
  attn = m.d_model * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads) * 2
  router = m.d_model * e.num_experts * 4          # float32
  dense_ffn = 3 * m.d_model * m.ffn_hidden * 2
  norms = 2 * m.d_model * 2
  assert other == (m.num_layers * (attn + norms) + moe_layers * router
                   + e.first_dense_layers * dense_ffn + m.d_model * 2)  # + final norm


def test_kv_bytes_read_counts_every_layer():
  cfg = load_config(TINY)
  m = cfg.model
  assert bd.kv_bytes_read(cfg, 3, 100) == 2 * 3 * m.num_kv_heads * 100 * m.head_dim * 2 * m.num_layers
  two_bit = with_overrides(cfg, ["kv_cache.bits=2"])
  assert 0 < bd.kv_bytes_read(two_bit, 3, 4096) < bd.kv_bytes_read(cfg, 3, 4096) / 4


def test_cases_add_the_peer_and_ours_at_its_depth():
  cfg = load_config(TINY)
  cs = bd.cases(cfg, batches=[1], contexts=[64], expert_bits=[4], kv_bits=[2], layers=None,
                peer_layers=1)
  assert [(c.expert_impl, c.layers, c.expert_bits, c.kv_bits) for c in cs] == [
      ("gmm", cfg.model.num_layers, 4, 2), ("gmm", 1, 4, 2), ("ragged", 1, 16, 16)]


def test_smoke_run_writes_the_table_and_json(tmp_path, capsys):
  out = tmp_path / "bench.json"
  rc = cli.main(["bench-decode", TINY, "--smoke", "--expert-bits", "4", "--kv-bits", "16",
                 "--peer-layers", "2", "--layers", "3", "--out", str(out)])
  assert rc == 0
  rows = json.loads(out.read_text())["rows"]
  assert [r["label"] for r in rows] == ["moejax int4", "moejax int4", bd.PEER_LABEL]
  for r in rows:
    assert r["ms_per_token"] > 0 and r["compile_s"] > 0 and r["kv_MB"] > 0
    assert 1 <= r["experts_touched_per_layer"] <= 2          # batch 1, top-2
  assert "ms/tok" in capsys.readouterr().out


def test_a_slope_hidden_by_noise_falls_back_to_the_whole_call_and_says_so():
  from moejax.inference.timing import step_seconds
  assert step_seconds(1.0, 3.0, 8, 40) == (2.0 / 32, True)
  # noise made the longer loop read faster: never a negative or zero time per step
  assert step_seconds(1.0, 0.9, 2, 4) == (0.9 / 4, False)
  row = dict(label="x", expert_bits=4, kv_bits=16, batch=1, context=8, layers=1,
             ms_per_token=1.0, tokens_per_s=1e3, ttft_ms=1.0, compile_s=1.0,
             experts_touched_per_layer=2.0, expert_MB=1.0, other_weights_MB=1.0, kv_MB=1.0,
             TBps=0.1, frac_of_copy=0.1)
  assert "upper bound" not in bd.format_row(row)
  assert "upper bound" in bd.format_row({**row, "ms_per_token_is_upper_bound": True})


@pytest.mark.parametrize("argv, match", [
    (["--expert-bits", "5"], "--expert-bits 5"),
    (["--kv-bits", "7"], "--kv-bits 7"),
    (["--steps", "8,4"], "--steps"),
])
def test_bad_arguments_are_refused(tmp_path, capsys, argv, match):
  rc = cli.main(["bench-decode", TINY, "--smoke", "--out", str(tmp_path / "x.json"), *argv])
  assert rc == 2 and match in capsys.readouterr().err
  assert not (tmp_path / "x.json").exists()


@pytest.mark.slow  # ~15 s; test_smoke_run_writes_the_table_and_json covers the same path
def test_smoke_runs_on_the_mixtral_config(tmp_path):
  """--smoke shrinks every size a full-size config sets (its BPE vocabulary included)."""
  out = tmp_path / "bench.json"
  mixtral = "configs/mixtral_8x7b.yaml"
  rc = cli.main(["bench-decode", mixtral, "--smoke", "--expert-bits", "4", "--kv-bits", "2",
                 "--peer-layers", "0", "--out", str(out)])
  assert rc == 0
  assert [r.get("error") for r in json.loads(out.read_text())["rows"]] == [None]
