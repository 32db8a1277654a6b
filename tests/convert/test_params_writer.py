"""checkpoint.ParamsWriter, the piecewise writer behind `moejax import`: its checkpoint is the
one Checkpointer.save_params writes (same arrays, metadata and meta item, read by the
unchanged restore_params), it appears only when closed, and an import written in many
pieces equals one written in one (float and quantized experts); a failure mid-way leaves
nothing behind."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from moejax.checkpoint import Checkpointer, ParamsWriter
from moejax.config import load_config
from moejax.convert import TensorShapeError, import_checkpoint
from moejax.convert.hf import read_hf_folder
from moejax.inference import load_trained
from moejax.state import abstract_model, fill_state

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
TINY = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
        "model.head_dim=16", "model.vocab_size=256", "moe.num_experts=4", "moe.expert_hidden=16",
        "model.dtype=bfloat16", "model.param_dtype=bfloat16"]


def _flat(params) -> dict:
  return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params)}


def _restored(directory: Path, cfg) -> tuple[dict, dict]:
  _, params, buffers = abstract_model(cfg)
  params, _, meta = Checkpointer(directory).restore_params(params, buffers, cfg)
  return _flat(params), meta


def test_pieces_restore_like_save_params(tmp_path):
  cfg = load_config(None, TINY)
  _, template, buffers = abstract_model(cfg)
  rng = np.random.default_rng(0)
  params = fill_state(template, {   # random values: building the model would take seconds
      p: jax.numpy.asarray(rng.standard_normal(v.get_value().shape), v.get_value().dtype)
      for p, v in nnx.to_flat_state(template)})
  extra = {"data_step": 0, "imported_from": "x"}
  ckpt = Checkpointer(tmp_path / "whole", keep=1)
  ckpt.save_params(0, params, buffers, cfg, extra)
  ckpt.close()

  writer = ParamsWriter(tmp_path / "pieces", 0, cfg, extra, piece_bytes=4096)
  flat = list(nnx.to_flat_state(params))
  for i in range(0, len(flat), 3):   # a few leaves at a time, in no particular grouping
    writer.add(nnx.from_flat_state(flat[i:i + 3]))
  with pytest.raises(ValueError, match="added twice"):
    writer.add(nnx.from_flat_state(flat[:1]))
  assert not (tmp_path / "pieces" / "0").exists()   # appears only when closed
  assert Checkpointer(tmp_path / "pieces").latest_step() is None
  writer.close()
  assert writer.pieces > 3

  (a, meta_a), (b, meta_b) = _restored(tmp_path / "whole", cfg), _restored(tmp_path / "pieces", cfg)
  assert a.keys() == b.keys() == dict(flat).keys() and meta_a == meta_b
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))
  # The same orbax metadata: keys, value types, array format.
  read = lambda d: json.loads((d / "0" / "state" / "_METADATA").read_text())
  ma, mb = read(tmp_path / "whole"), read(tmp_path / "pieces")
  assert ma.keys() == mb.keys() and ma["use_zarr3"] == mb["use_zarr3"] and mb["use_ocdbt"]
  assert {k: v["value_metadata"] for k, v in ma["tree_metadata"].items()} == {
      k: v["value_metadata"] for k, v in mb["tree_metadata"].items()}
  assert sorted(p.name for p in (tmp_path / "pieces").iterdir()) == ["0"]   # no scratch left

  with pytest.raises(ValueError, match="no arrays"):
    ParamsWriter(tmp_path / "empty", 0, cfg).close()
  with pytest.raises(FileExistsError):   # the step is there already
    ParamsWriter(tmp_path / "pieces", 0, cfg)
  # Pieces an interrupted writer left would join the next checkpoint: refused.
  stale = ParamsWriter(tmp_path / "stale", 0, cfg, piece_bytes=1)
  stale.add(nnx.from_flat_state(flat[:1]))
  with pytest.raises(FileExistsError, match="0.pieces"):
    ParamsWriter(tmp_path / "stale", 0, cfg)


@pytest.mark.parametrize("name, options", [("mixtral", {"dtype": "float32"}),
                                           ("qwen3moe", {"dtype": "float32", "expert_bits": 8,
                                                         "group_size": 0})])
def test_many_pieces_give_the_run_of_one(tmp_path, name, options):
  """Every array in its own orbax save (piece_bytes=1) against the fixtures' single save."""
  hf_config, src, tokenizer_json = read_hf_folder(FIXTURES / name)
  with src:
    one = import_checkpoint(hf_config, src, tokenizer_json, tmp_path / "one", **options)
    many = import_checkpoint(hf_config, src, tokenizer_json, tmp_path / "many", piece_bytes=1,
                             **options)
  assert one["params"] == many["params"]
  a, b = load_trained(tmp_path / "one"), load_trained(tmp_path / "many")
  fa, fb = _flat(a.params), _flat(b.params)
  assert fa.keys() == fb.keys() and a.step == b.step == 0
  assert (a.cfg.model, a.cfg.moe, a.cfg.inference) == (b.cfg.model, b.cfg.moe, b.cfg.inference)
  for k in fa:
    np.testing.assert_array_equal(fa[k], fb[k], err_msg=str(k))


def test_failure_mid_write_leaves_nothing(tmp_path):
  """A wrong shape that only reading reveals, after pieces were written: neither OUT_DIR, its
  temporary sibling nor the parent directories made for it remain."""
  hf_config, src, _ = read_hf_folder(FIXTURES / "mixtral")
  with src:
    tensors = {k: (lambda k=k: src.get(k)) for k in src.keys()}
    last = "model.layers.1.post_attention_layernorm.weight"
    tensors[last] = lambda: np.zeros(31, np.float32)
    with pytest.raises(TensorShapeError, match=last):
      import_checkpoint(hf_config, tensors, None, tmp_path / "new" / "dirs" / "out",
                        piece_bytes=1)
    assert not any(tmp_path.iterdir())
    # An existing parent stays (only what the import made goes).
    (tmp_path / "keep").mkdir()
    with pytest.raises(TensorShapeError):
      import_checkpoint(hf_config, tensors, None, tmp_path / "keep" / "out", piece_bytes=1)
  assert [p.name for p in tmp_path.iterdir()] == ["keep"]
  assert not any((tmp_path / "keep").iterdir())
