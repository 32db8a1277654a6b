"""`moejax import` of Hugging Face folders: logits against transformers' own (fixtures from
make_fixtures.py), both expert namings, shards, refusals, the imported run in eval and
generate, quantized experts, that tensors stream one at a time and that converted arrays
are written as they are built (never the whole model in memory)."""
from __future__ import annotations

import json
import shutil
import tracemalloc
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import cli
from moejax.checkpoint import Checkpointer, load_run_config
from moejax.convert import TensorShapeError, UnsupportedModelError, import_checkpoint
from moejax.convert.hf import SafetensorsSource, import_model, read_hf_folder
from moejax.inference import Engine, end_token_ids, load_trained
from moejax.inference.quantize import quantize_run
from moejax.state import abstract_model

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
NAMES = ("llama_tied_sharded", "llama_rope_scaled", "mixtral", "mixtral_fused", "olmoe",
         "qwen2moe_fused", "qwen3moe")
TOLERANCE = 1e-4   # float32; measured at most 7.6e-6 (logits of magnitude ~5)


def _logits(run_dir: Path, tokens_BT, overrides=()):
  tm = load_trained(run_dir, list(overrides))
  logits_BTV, _, _ = tm.module()(jnp.asarray(tokens_BT))
  return np.asarray(logits_BTV)


def _diff(run_dir: Path, fixture: Path, overrides=()) -> float:
  ref = np.load(fixture / "logits.npy")
  return float(np.abs(_logits(run_dir, np.load(fixture / "tokens.npy"), overrides) - ref).max())


def _params(run_dir: Path) -> dict:
  """A run's arrays by path (no tokenizer needed)."""
  cfg = load_run_config(run_dir)
  _, params, buffers = abstract_model(cfg)
  params, _, _ = Checkpointer(run_dir / "checkpoints").restore_params(params, buffers, cfg)
  return {jax.tree_util.keystr(p): np.asarray(v)
          for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  """Every fixture imported in float32, once: name -> run directory."""
  root = tmp_path_factory.mktemp("imported")
  return {name: import_model(FIXTURES / name, root / name, dtype="float32")["run_dir"]
          for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(imported, name):
  assert _diff(Path(imported[name]), FIXTURES / name) <= TOLERANCE


def test_the_options_the_fixtures_use_are_what_makes_them_match(imported):
  """Without OLMoE's clip_qkv or Llama 3's RoPE scaling the logits move: the fixtures
  exercise them (a no-op option would pass the parity test above vacuously)."""
  assert _diff(Path(imported["olmoe"]), FIXTURES / "olmoe", ["model.clip_qkv=0"]) > 1e-3
  assert _diff(Path(imported["llama_rope_scaled"]), FIXTURES / "llama_rope_scaled",
               ["model.rope_scaling=none"]) > 1e-3


def test_config_translation(imported):
  """What each architecture's settings became (spot checks of the moejax config)."""
  cfgs = {n: load_trained(Path(imported[n])).cfg for n in ("llama_tied_sharded", "olmoe",
                                                            "qwen2moe_fused", "qwen3moe")}
  llama = cfgs["llama_tied_sharded"]
  assert llama.model.tie_embeddings and llama.moe.first_dense_layers == 2   # no MoE layer
  assert cfgs["olmoe"].model.qk_norm == "full" and cfgs["olmoe"].model.clip_qkv == 1.5
  q2 = cfgs["qwen2moe_fused"]
  assert q2.model.qkv_bias and q2.moe.shared_expert_gate and q2.moe.dense_layers == (0,)
  assert not q2.moe.renormalize and q2.moe.shared_expert_hidden == 40
  q3 = cfgs["qwen3moe"]
  assert q3.model.qk_norm == "head" and q3.model.head_dim == 16 and q3.moe.renormalize
  assert llama.data.tokenizer == "hf" and llama.data.eos_id == 0


def _fused_source(folder: Path, layers: int, experts: int) -> tuple[dict, dict]:
  """A per-expert (gate_proj / up_proj / down_proj) checkpoint renamed to the fused layout,
  as a {name: loader} dict: (hf_config, tensors)."""
  hf_config, src, _ = read_hf_folder(folder)
  with src:
    flat = {k: src.get(k) for k in src.keys()}
  for i in range(layers):
    p = f"model.layers.{i}.mlp.experts"
    w = {kind: np.stack([flat.pop(f"{p}.{j}.{kind}.weight") for j in range(experts)])
         for kind in ("gate_proj", "up_proj", "down_proj")}
    flat[f"{p}.gate_up_proj"] = np.concatenate([w["gate_proj"], w["up_proj"]], axis=1)
    flat[f"{p}.down_proj"] = w["down_proj"]
  return hf_config, {k: (lambda v=v: v) for k, v in flat.items()}


def test_fused_and_per_expert_namings_give_the_same_run(imported, tmp_path):
  hf_config, tensors = _fused_source(FIXTURES / "olmoe", 2, 4)
  assert any(k.endswith("experts.gate_up_proj") for k in tensors)
  import_checkpoint(hf_config, tensors, None, tmp_path / "fused", dtype="float32")
  fused, per_expert = _params(tmp_path / "fused"), _params(Path(imported["olmoe"]))
  assert fused.keys() == per_expert.keys()
  for k in fused:
    np.testing.assert_array_equal(fused[k], per_expert[k], err_msg=k)


def test_sharded_checkpoint_reads_every_shard():
  folder = FIXTURES / "llama_tied_sharded"
  shards = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
  assert len(set(shards.values())) >= 2
  with SafetensorsSource.from_folder(folder) as src:
    assert set(src.keys()) == set(shards)


def _copy(name: str, tmp_path: Path) -> Path:
  return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def _edit_config(folder: Path, **changes) -> None:
  path = folder / "config.json"
  path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_clear_errors_and_nothing_written(tmp_path, capsys):
  out = tmp_path / "out"
  cases = []
  folder = _copy("llama_tied_sharded", tmp_path)
  (folder / "model-00002-of-00002.safetensors").unlink()
  cases.append((folder, "model-00002-of-00002.safetensors, which is missing"))
  cases.append((tmp_path / "nowhere", "no such directory"))
  (tmp_path / "empty").mkdir()
  cases.append((tmp_path / "empty", "no config.json"))
  unknown = _copy("mixtral", tmp_path / "u")
  _edit_config(unknown, architectures=["GPT2LMHeadModel"])
  cases.append((unknown, "architecture GPT2LMHeadModel is not supported"))
  shape = _copy("mixtral", tmp_path / "s")
  _edit_config(shape, num_key_value_heads=4)
  cases.append((shape, "tensor model.layers.0.self_attn.k_proj.weight has shape (16, 32); "
                       "the config implies (32, 32)"))
  for src, message in cases:
    assert cli.main(["import", str(src), str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".out.*"))
  # Refusals of the request itself: a non-empty OUT_DIR, experts to quantize on a dense model.
  out.mkdir()
  (out / "keep.txt").write_text("x")
  assert cli.main(["import", str(FIXTURES / "mixtral"), str(out)]) == 2
  assert "not an empty directory" in capsys.readouterr().err
  assert [p.name for p in out.iterdir()] == ["keep.txt"]
  assert cli.main(["import", str(FIXTURES / "llama_rope_scaled"), str(tmp_path / "q"),
                   "--expert-bits", "8"]) == 2
  assert "no MoE layers" in capsys.readouterr().err and not (tmp_path / "q").exists()


def test_unsupported_tensor_and_shape_from_a_lazy_source(tmp_path):
  hf_config, src, _ = read_hf_folder(FIXTURES / "mixtral")
  with src:
    tensors = {k: (lambda k=k: src.get(k)) for k in src.keys()}
    extra = {**tensors, "model.layers.0.self_attn.sinks": lambda: np.zeros(4, np.float32)}
    with pytest.raises(UnsupportedModelError, match="model.layers.0.self_attn.sinks"):
      import_checkpoint(hf_config, extra, None, tmp_path / "a")
    # Without .shape() the check happens as the tensor is read; still nothing is written.
    bad = {**tensors, "model.norm.weight": lambda: np.zeros(31, np.float32)}
    with pytest.raises(TensorShapeError, match=r"model.norm.weight has shape \(31,\)"):
      import_checkpoint(hf_config, bad, None, tmp_path / "b")
  assert not any(tmp_path.iterdir())


def test_imported_run_evaluates_and_generates(tmp_path, capsys):
  """The default bf16 import, through `moejax eval` and Engine.generate with its tokenizer
  and end-of-text stop token."""
  run = tmp_path / "run"
  assert cli.main(["import", str(FIXTURES / "mixtral"), str(run)]) == 0
  summary = json.loads(capsys.readouterr().out)
  assert summary["architecture"] == "MixtralForCausalLM" and summary["dtype"] == "bfloat16"
  assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml", "import.json",
                                                   "tokenizer.json"]
  text = tmp_path / "a.txt"
  text.write_text("to be or not to be, that is the question.\n" * 400)
  assert cli.main(["eval", str(run), "data.corpus=files", f"data.files={text}",
                   "data.batch_size=2", "data.seq_len=32", "--max-batches", "1"]) == 0
  result = json.loads(capsys.readouterr().out)
  assert np.isfinite(result["val_loss"]) and result["val_bpb"] > 0 and result["step"] == 0

  tm = load_trained(run)
  assert end_token_ids(tm.tokenizer) == (0,)
  prompt = tm.tokenizer.encode("Whether 'tis nobler")
  assert tm.tokenizer.decode(prompt) == "Whether 'tis nobler"
  (new_ids,), _ = Engine.from_trained(tm).generate([prompt], 4, stop_tokens=(0,))
  assert 1 <= len(new_ids) <= 4 and isinstance(tm.tokenizer.decode(new_ids), str)


def test_quantized_import_equals_quantizing_the_imported_run(imported, tmp_path):
  """--expert-bits 8 quantizes each layer as `moejax quantize` does: identical arrays."""
  import_model(FIXTURES / "qwen3moe", tmp_path / "q8", dtype="float32", expert_bits=8,
               group_size=0)
  quantize_run(imported["qwen3moe"], tmp_path / "requantized", 8, group_size=0)
  a, b = _params(tmp_path / "q8"), _params(tmp_path / "requantized")
  assert a.keys() == b.keys() and any("codes" in k for k in a)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  diff = _diff(tmp_path / "q8", FIXTURES / "qwen3moe")
  print(f"int8 experts (per channel): max abs logit diff {diff:.3g}")
  assert diff < 0.1


def _synthetic_mixtral(folder: Path, layers=4, E=8, D=64, F=128, V=512) -> int:
  """A random Mixtral checkpoint (per-expert tensors) written with safetensors; -> bytes."""
  from safetensors.numpy import save_file
  rng = np.random.default_rng(0)
  w = lambda *shape: (0.05 * rng.standard_normal(shape)).astype(np.float32)
  tensors = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": w(D),
             "lm_head.weight": w(V, D)}
  for i in range(layers):
    p = f"model.layers.{i}"
    tensors.update({f"{p}.input_layernorm.weight": w(D), f"{p}.post_attention_layernorm.weight":
                    w(D), f"{p}.block_sparse_moe.gate.weight": w(E, D)})
    tensors.update({f"{p}.self_attn.{x}_proj.weight": w(D, D) for x in "qkvo"})
    for j in range(E):
      for kind, shape in (("w1", (F, D)), ("w3", (F, D)), ("w2", (D, F))):
        tensors[f"{p}.block_sparse_moe.experts.{j}.{kind}.weight"] = w(*shape)
  folder.mkdir()
  save_file(tensors, str(folder / "model.safetensors"))
  (folder / "config.json").write_text(json.dumps({
      "architectures": ["MixtralForCausalLM"], "vocab_size": V, "hidden_size": D,
      "intermediate_size": F, "num_hidden_layers": layers, "num_attention_heads": 4,
      "num_key_value_heads": 4, "num_local_experts": E, "num_experts_per_tok": 2,
      "max_position_embeddings": 256}))
  return sum(t.nbytes for t in tensors.values())


class _CountingSource:
  """Wraps a TensorSource: counts the source arrays alive at once (weakrefs)."""

  def __init__(self, inner):
    self.inner, self.alive, self.max_alive, self.reads = inner, 0, 0, 0

  def keys(self):
    return self.inner.keys()

  def shape(self, name):
    return self.inner.shape(name)

  def _released(self):
    self.alive -= 1

  def get(self, name):
    x = self.inner.get(name)
    self.alive, self.reads = self.alive + 1, self.reads + 1
    self.max_alive = max(self.max_alive, self.alive)
    weakref.finalize(x, self._released)
    return x


def test_tensors_stream_one_at_a_time(tmp_path):
  """Source tensors are dropped as they are placed: at most one is alive at a time, and the
  import's traced host allocations peak far below the checkpoint's size (bf16 target)."""
  total = _synthetic_mixtral(tmp_path / "big")
  hf_config, src, _ = read_hf_folder(tmp_path / "big")
  counting = _CountingSource(src)
  import_checkpoint(hf_config, counting, None, tmp_path / "warm", dtype="bfloat16")  # compile
  counting.max_alive = counting.reads = 0
  tracemalloc.start()
  base = tracemalloc.get_traced_memory()[0]
  import_checkpoint(hf_config, counting, None, tmp_path / "run", dtype="bfloat16")
  peak = tracemalloc.get_traced_memory()[1] - base
  tracemalloc.stop()
  biggest = max(int(np.prod(src.shape(k))) * 4 for k in src.keys())
  src.close()
  print(f"checkpoint {total / 2**20:.2f} MiB in {len(list(src.keys()))} tensors (largest "
        f"{biggest / 2**10:.0f} KiB); at most {counting.max_alive} alive at once; traced "
        f"peak {peak / 2**20:.2f} MiB")
  assert counting.reads == len(list(src.keys())) and counting.max_alive == 1
  assert peak < total / 2   # loading the model whole would trace >= total


def _live_buffers() -> dict[int, int]:
  return {a.unsafe_buffer_pointer(): a.nbytes for a in jax.live_arrays()}


class _HeldArrays(_CountingSource):
  """Also records, at every tensor read, the bytes of live jax arrays (distinct buffers, but
  those alive before `start`, e.g. other tests'): converted parameters sit on the CPU
  device, i.e. in host memory, until they are written."""

  def start(self):
    self.before, self.max_held = set(_live_buffers()), 0

  def get(self, name):
    held = sum(n for p, n in _live_buffers().items() if p not in self.before)
    self.max_held = max(self.max_held, held)
    return super().get(name)


def test_import_holds_a_piece_not_the_model(tmp_path):
  """Converted parameters go to disk as they are built, not once the model is complete. An
  8-layer Mixtral, 3.4 MiB in bf16, written in 128 KiB pieces: at every read the import
  holds no more converted arrays than a pending piece plus the largest target (a layer's
  stacked experts, 384 KiB), under a sixth of the model. Holding the converted model for
  one save at the end (the code before ParamsWriter) holds all but the last layer, 3 MiB,
  by the last read."""
  _synthetic_mixtral(tmp_path / "big", layers=8)
  hf_config, src, _ = read_hf_folder(tmp_path / "big")
  model = sum(int(np.prod(src.shape(k))) * 2 for k in src.keys())   # bf16
  held = _HeldArrays(src)
  import_checkpoint(hf_config, src, None, tmp_path / "one_save")   # one piece (PIECE_BYTES)
  piece = 128 * 2**10
  held.start()
  summary = import_checkpoint(hf_config, held, None, tmp_path / "run", piece_bytes=piece)
  src.close()
  largest_target = 3 * 8 * 64 * 128 * 2
  print(f"bf16 model {model / 2**20:.2f} MiB; converted arrays held at most "
        f"{held.max_held / 2**10:.0f} KiB")
  assert held.max_held <= piece + largest_target < model / 6
  # Many pieces, one checkpoint: the arrays of the single-save import, bit for bit.
  assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["0"]
  a, b = _params(tmp_path / "run"), _params(tmp_path / "one_save")
  assert a.keys() == b.keys() and summary["params"] == sum(v.size for v in a.values())
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_new_model_options_train_and_leave_default_keys_alone():
  """The import's model options are training options too (finite gradients through all of
  them), and a model without them has exactly the parameter keys it had before."""
  from flax import nnx
  from moejax.config import load_config
  from moejax.state import build_model, forward_loss, split_model
  default = [p for p, _ in nnx.to_flat_state(abstract_model(load_config(None))[1])]
  assert not [p for p in default if any(n in p[-1] for n in ("bias_", "shared_gate"))
              or "q_norm" in p or "k_norm" in p]
  cfg = load_config(None, ["model.d_model=32", "model.num_layers=2", "model.num_heads=2",
                           "model.num_kv_heads=1", "model.head_dim=16", "model.qkv_bias=true",
                           "model.qk_norm=full", "model.clip_qkv=2", "model.rope_scaling=llama3",
                           "model.rope_factor=4", "model.rope_original_max_len=32",
                           "moe.num_experts=4", "moe.expert_hidden=16",
                           "moe.num_shared_experts=1", "moe.shared_expert_gate=true",
                           "moe.dense_layers=[0]", "moe.expert_impl=dense"])
  graphdef, params, buffers = split_model(build_model(cfg, 0))
  tokens = jnp.arange(32, dtype=jnp.int32).reshape(2, 16) % 200
  grads = jax.jit(jax.grad(lambda p: forward_loss(cfg, graphdef, p, buffers, tokens, tokens)[0]))(
      params)
  flat = {jax.tree_util.keystr(p): g for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
  assert any("shared_gate_D" in k for k in flat) and any("q_bias_HA" in k for k in flat)
  assert all(bool(jnp.isfinite(g).all()) for g in flat.values())
