"""`moejax quantize`: a trained run to a new run directory with int8 / int4 experts, which
`moejax eval` scores; every refusal writes nothing."""
import json
import re
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from moejax import cli, train as train_mod
from moejax.checkpoint import Checkpointer
from moejax.config import ConfigError, load_config
from moejax.inference.quantize import quantize_run
from moejax.state import build_model, split_model

# d_model = expert_hidden = 32: int4 groups of 16 rows divide D/2 and F/2.
SMALL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
         "model.head_dim=16", "model.ffn_hidden=48", "moe.expert_hidden=32", "moe.num_experts=4",
         "model.max_seq_len=64", "data.seq_len=16", "data.batch_size=4", "train.log_every=2",
         "train.eval_every=4", "train.eval_batches=2", "train.checkpoint_every=4",
         "train.warmup_steps=2", "train.tensorboard=false", "train.steps=4"]


def _cfg(tmp: Path, run: str, *extra):
  return load_config(None, SMALL + ["data.corpus=files", f"data.files={tmp / 'a.txt'}",
                                    f"train.out_dir={tmp / run}", *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A run trained 4 steps, and a run with no MoE layer (checkpointed, not trained)."""
  tmp = tmp_path_factory.mktemp("quantize")
  rng = np.random.default_rng(0)
  words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis"]
  (tmp / "a.txt").write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(400)))
  train_mod.train(_cfg(tmp, "run"), quiet=True)
  dense = _cfg(tmp, "dense", "moe.first_dense_layers=2")
  _, params, buffers = split_model(build_model(dense, 0))
  Checkpointer(tmp / "dense" / "checkpoints").save_params(0, params, buffers, dense)
  return tmp


def _eval(run: Path, capsys, *extra) -> dict:
  capsys.readouterr()
  assert cli.main(["eval", str(run), *extra, "--max-batches", "2"]) == 0
  return json.loads(capsys.readouterr().out)


def _tree(path: Path) -> dict[str, bytes]:
  return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
          if p.is_file()}


@pytest.mark.parametrize("bits, group", [(4, 16), (8, 0)])
def test_quantize_then_eval(trained, capsys, bits, group):
  run, out = trained / "run", trained / f"q{bits}"
  (run / "tokenizer.model").write_bytes(b"a tokenizer model")   # copied when a run has one
  before = _tree(run)
  assert cli.main(["quantize", str(run), str(out), "--expert-bits", str(bits),
                   "--group-size", str(group)]) == 0
  summary = json.loads(capsys.readouterr().out)
  assert _tree(run) == before                                   # the source is only read
  assert (out / "tokenizer.model").read_bytes() == b"a tokenizer model"
  assert not [p for p in trained.iterdir() if p.name.endswith(".tmp")]
  cfg = load_config(out / "config.yaml")
  assert (cfg.inference.expert_bits, cfg.inference.expert_group_size) == (bits, group)
  # The checkpoint holds integer codes and float32 scales, and no float expert matrix.
  ckpt = Checkpointer(out / "checkpoints")
  assert ckpt.latest_step() == summary["step"] == 4
  saved = ckpt.manager.item_metadata(4)["state"]
  codes = {k: v.dtype for k, v in saved.items() if "_codes" in k}
  assert len(codes) == 4 and set(codes.values()) == {np.dtype(np.int8 if bits == 8 else np.uint8)}
  assert not [k for k in saved if "w_gate_EDF" in k or "opt_state" in k]
  # Bytes: bf16 experts 2 bytes per weight; codes 1 (int8) or 1/2 (int4) + f32 scales.
  E, D, F = 4, 32, 32
  assert summary["expert_bytes_16bit"] == 2 * 3 * E * D * F * 2   # two MoE layers
  # f32 scales: one per output channel over I = 32 rows, or one per group of 16 rows.
  per_weight = {8: 1 + 4 / 32, 4: 0.5 + 4 / 16}[bits]
  assert summary["expert_bytes"] == per_weight * 2 * 3 * E * D * F
  # Eval loads it like any run; the loss moves by the quantization error only.
  base, quant = _eval(run, capsys), _eval(out, capsys)
  assert quant["step"] == 4 and quant["val_tokens"] == base["val_tokens"]
  assert quant["val_loss"] == pytest.approx(base["val_loss"], rel=0.01)
  if bits == 4:   # codes into the Pallas kernel (interpreted: slow, so for one case)
    gmm = _eval(out, capsys, "moe.expert_impl=gmm")
    assert gmm["val_loss"] == pytest.approx(quant["val_loss"], rel=1e-4)
  # The quantized run's shapes are fixed: loading it with other expert bits is refused.
  assert cli.main(["eval", str(out), "inference.expert_bits=16"]) == 2
  assert "inference.expert_bits" in capsys.readouterr().err


def test_refusals_write_nothing(trained, capsys):
  run = trained / "run"
  (trained / "full").mkdir(exist_ok=True)
  (trained / "full" / "keep.txt").write_text("mine")
  (trained / "empty").mkdir(exist_ok=True)
  cases = [
      ([run, trained / "new", "--expert-bits", "16"], "must be 8 or 4"),
      ([run, trained / "new", "--expert-bits", "3"], "must be 8 or 4"),
      ([run, trained / "new", "--expert-bits", "4", "--group-size", "24"],
       "--group-size 24: .*must divide model.d_model/2=16"),
      ([run, trained / "new", "--expert-bits", "8", "--group-size", "-1"], "must be >= 0"),
      ([trained / "missing", trained / "new", "--expert-bits", "4"], "not a run directory"),
      ([trained / "empty", trained / "new", "--expert-bits", "4"], "not a run directory"),
      ([run, trained / "full", "--expert-bits", "4"], "already exists and is not an empty"),
      ([run, run, "--expert-bits", "4"], "OUT_DIR is RUN_DIR"),
      ([trained / "dense", trained / "new", "--expert-bits", "4"], "no MoE layers"),
  ]
  before = _tree(trained)
  for args, message in cases:
    assert cli.main(["quantize", *map(str, args)]) == 2, args
    err = capsys.readouterr().err
    assert err.startswith("moejax quantize: error:") and err.count("\n") == 1, err
    assert re.search(message, err), (args, err)
    assert _tree(trained) == before, args
    assert not (trained / "new").exists()
    assert sorted(p.name for p in trained.iterdir() if p.name.startswith(".")) == []
  # An already quantized run is refused too (quantize the 16-bit run it came from).
  quantize_run(run, trained / "q_once", 8, 0)
  with pytest.raises(ValueError, match="already quantized"):
    quantize_run(trained / "q_once", trained / "new", 4, 16)
  assert not (trained / "new").exists()
  # An empty OUT_DIR is fine: it becomes the run.
  quantize_run(run, trained / "empty", 4, 16)
  assert (trained / "empty" / "config.yaml").is_file()


def test_training_with_quantized_experts_is_refused(trained, capsys):
  out = trained / "never"
  with pytest.raises(ConfigError, match="cannot be trained"):
    train_mod.train(_cfg(trained, "never", "inference.expert_bits=4",
                         "inference.expert_group_size=16"), quiet=True)
  assert cli.main(["train", "configs/tiny.yaml", *SMALL, f"train.out_dir={out}",
                   "inference.expert_bits=8", "inference.expert_group_size=0"]) == 2
  assert "moejax quantize RUN_DIR OUT_DIR --expert-bits 8" in capsys.readouterr().err
  assert not out.exists()
