"""experiments/bench_offload.py --smoke on the CPU: the table's rows reach the JSON (the
timings mean nothing here; the bytes and hits do)."""
import importlib.util
import json
from pathlib import Path

SPEC = importlib.util.spec_from_file_location(
    "bench_offload", Path(__file__).resolve().parents[2] / "experiments" / "bench_offload.py")
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)


def test_smoke_rows_reach_the_json(tmp_path):
  out = tmp_path / "offload.json"
  bench.main(["--smoke", "--budgets", "50", "--policies", "lru", "predictive", "--no-probe",
              "--out", str(out)])
  result = json.loads(out.read_text())
  rows = result["rows"]
  assert [(r["budget_pct"], r["policy"], r.get("error")) for r in rows] == [
      (50, "lru", None), (50, "predictive", None)]
  lru, predictive = rows
  assert 0 < lru["slots"] < lru["total_experts"]
  assert 0 <= lru["hit_rate"] < 1 and lru["MB_h2d_per_token"] > 0
  assert lru["prefetches_per_step"] == 0 < predictive["prefetches_per_step"]
  assert result["h2d_GBps"] > 0 and result["in_hbm_ms"] > 0
  assert result["in_hbm_misses"] == 0          # the all-resident baseline is preloaded


def test_each_row_is_saved_as_it_is_timed(tmp_path, monkeypatch):
  """A run cut short (a device time limit) keeps the rows it finished."""
  out = tmp_path / "offload.json"
  real_row, seen = bench.row, []

  def row_then_check(*args, **kw):
    if seen:   # the first row is on disk before the second is timed
      assert [r["policy"] for r in json.loads(out.read_text())["rows"]] == ["lru"]
    seen.append(1)
    return real_row(*args, **kw)

  monkeypatch.setattr(bench, "row", row_then_check)
  bench.main(["--smoke", "--budgets", "50", "--policies", "lru", "lfu", "--no-probe",
              "--out", str(out)])
  assert len(seen) == 2
