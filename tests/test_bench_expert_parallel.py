"""experiments/bench_expert_parallel.py runs end to end on 2 virtual CPU devices (~40 s,
nearly all XLA compiles) and writes every row of its JSON without errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SMALL = ["model.d_model=16", "model.num_layers=1", "moe.first_dense_layers=0",
         "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=8", "model.ffn_hidden=16",
         "moe.expert_hidden=8", "data.batch_size=4", "data.seq_len=8"]


@pytest.mark.slow
def test_bench_expert_parallel_smoke(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), OUT=str(tmp_path),
             XLA_FLAGS="--xla_force_host_platform_device_count=2 "
                       "--xla_backend_optimization_level=0")
  out = subprocess.run([sys.executable, str(REPO / "experiments" / "bench_expert_parallel.py"),
                        *SMALL, "--devices", "1", "2", "--steps", "1", "--warmup", "1",
                        "--decode-steps", "1", "--decode-batches", "1"],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-4000:]
  res = json.loads((tmp_path / "bench_expert_parallel.json").read_text())
  assert res["nccl_env"].get("NCCL_NVLS_ENABLE") == "0"
  for mode in ("weak", "strong", "decode"):
    assert [r["n"] for r in res[mode]] == [1, 2], res[mode]
    assert not [r for r in res[mode] if "error" in r], res[mode]
    assert res[mode][1]["a2a_share"] is not None and res[mode][1]["mesh"]["expert"] == 2
  assert res["weak"][1]["experts"] == 2 * res["weak"][0]["experts"]
  assert res["weak"][1]["batch"] == 2 * res["weak"][0]["batch"]
  assert res["strong"][1]["batch"] == res["strong"][0]["batch"] == 4
  assert res["decode"][1]["padded_batch"] == 2 and res["decode"][1]["batch"] == 1
  assert "| n | mesh |" in out.stdout
