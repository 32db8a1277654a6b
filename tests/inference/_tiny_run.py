"""A tiny trained run and a dense one for the end-to-end CLI tests of tests/inference
(configs/tiny.yaml at test size: layer 0 dense, top-2 of 4 experts)."""
import shutil
from pathlib import Path

import numpy as np

from moejax import train as train_mod
from moejax.checkpoint import Checkpointer
from moejax.config import load_config
from moejax.state import build_model, split_model


def small(layers: int, steps: int, max_seq_len: int) -> list[str]:
  return ["model.d_model=32", f"model.num_layers={layers}", "model.num_heads=2",
          "model.num_kv_heads=1", "model.head_dim=16", "model.ffn_hidden=48",
          "moe.expert_hidden=32", "moe.num_experts=4", f"model.max_seq_len={max_seq_len}",
          "data.seq_len=16", "data.batch_size=4", "train.log_every=2",
          f"train.eval_every={steps}", "train.eval_batches=2", f"train.checkpoint_every={steps}",
          "train.warmup_steps=2", "train.tensorboard=false", f"train.steps={steps}"]


def config(tmp: Path, overrides: list[str], run: str, *extra):
  return load_config("configs/tiny.yaml", overrides + [
      "data.corpus=files", f"data.files={tmp / 'a.txt'}", f"train.out_dir={tmp / run}", *extra])


def make_runs(tmp: Path, overrides: list[str]) -> Path:
  """tmp/run: trained on a small word corpus; tmp/dense: the same shape with no MoE layer,
  checkpointed untrained."""
  rng = np.random.default_rng(0)
  words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis"]
  (tmp / "a.txt").write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(400)))
  train_mod.train(config(tmp, overrides, "run"), quiet=True)
  layers = next(o for o in overrides if o.startswith("model.num_layers=")).split("=")[1]
  dense = config(tmp, overrides, "dense", f"moe.first_dense_layers={layers}")
  _, params, buffers = split_model(build_model(dense, 0))
  Checkpointer(tmp / "dense" / "checkpoints").save_params(0, params, buffers, dense)
  return tmp


def private_copy(runs: Path, tmp_path: Path, name: str = "run") -> Path:
  return Path(shutil.copytree(runs / name, tmp_path / name))


def tree(path: Path) -> dict[str, bytes]:
  return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
          if p.is_file()}
