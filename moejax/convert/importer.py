"""The writer behind `moejax import`: an HF config.json dict plus HF-named tensors, read one
at a time, -> a moejax run directory that eval, eval-ppl, calibrate, generate and
bench-decode load like a trained run.

Front ends: convert/hf.py (a Hugging Face model folder) and convert/gguf.py (a .gguf file,
which hands over HF names and HF layouts: GGUF's q/k row permutation already undone).

    import_checkpoint(hf_config, tensors, tokenizer_json, out_dir, *, dtype="bfloat16",
                      expert_bits=16, group_size=128, source="",
                      piece_bytes=PIECE_BYTES) -> summary dict

`tensors` is a TensorSource: `.keys()` and `.get(name)` returning the array (or a
zero-argument callable returning it, so a plain {name: loader} dict works); an optional
`.shape(name)` lets every shape be checked before any tensor is read. Each tensor is read,
converted into its place in the parameter tree and dropped before the next is read; a MoE
layer's experts are stacked into preallocated arrays one expert tensor at a time and, with
expert_bits 8 | 4, quantized before the next layer is read (quantize.py's per-layer code).
Converted arrays go to the checkpoint as they are built, piece_bytes at a time
(checkpoint.ParamsWriter), so the host holds about one layer, never the whole model.
The run directory holds config.yaml, a params-only checkpoint (step 0), tokenizer.json and
import.json. It is written into a temporary sibling and renamed into place: OUT_DIR is
absent (a refusal or failure) or complete. Every refusal happens before anything is written,
but for a wrong shape that only reading reveals (a source without `.shape`), which, like any
failure, leaves nothing behind.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable, Iterable, Protocol

import jax
import numpy as np
from flax import nnx

from moejax.atomic import write_atomic
from moejax.checkpoint import PIECE_BYTES, ParamsWriter
from moejax.config import EXPERT_BITS, Config, ConfigError, from_dict, save_config
from moejax.convert.mapping import (Target, UnsupportedModelError, architecture_of,
                                    check_names, config_from_hf, targets)
from moejax.data import HFTokenizer
from moejax.inference.quantize import moe_layer_paths, quantize_layer_experts
from moejax.model.moe import FLOAT_EXPERT_NAMES
from moejax.run_io import HF_TOKENIZER_FILE
from moejax.state import abstract_model, fill_state

SUMMARY_FILE = "import.json"
DTYPES = ("bfloat16", "float32")


class TensorSource(Protocol):
  def keys(self) -> Iterable[str]: ...
  def get(self, name: str) -> np.ndarray | Callable[[], np.ndarray]: ...


class TensorShapeError(UnsupportedModelError):
  """A tensor's shape is not the one the config implies."""


def check_out_dir(out_dir: Path) -> None:
  if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
    raise ValueError(f"{out_dir} already exists and is not an empty directory; choose a new "
                     "OUT_DIR")


def eos_id_of(hf_config: dict) -> int:
  """config.json's eos_token_id (the first, if a list) when it is a valid id, else -1."""
  eos = hf_config.get("eos_token_id")
  eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
  vocab = int(hf_config.get("vocab_size", 0))
  return int(eos) if isinstance(eos, int) and 0 <= eos < vocab else -1


def _configs(hf_config: dict, out_dir: Path, dtype: str, expert_bits: int, group_size: int) -> tuple[Config, Config]:
  """(the float model's config, the written model's config): equal for 16-bit experts."""
  if dtype not in DTYPES:
    raise ValueError(f"--dtype {dtype}: must be one of {', '.join(DTYPES)}")
  if expert_bits not in EXPERT_BITS:
    raise ValueError(f"--expert-bits {expert_bits}: must be 16, 8 or 4")
  cfg = config_from_hf(hf_config, dtype=dtype, out_dir=str(out_dir),
                       eos_id=eos_id_of(hf_config))
  if expert_bits == 16:
    return cfg, cfg
  if not moe_layer_paths(cfg):
    raise ValueError(f"{architecture_of(hf_config)}: the model has no MoE layers, so no "
                     f"expert weights to quantize (--expert-bits {expert_bits})")
  data = cfg.to_dict()
  data["inference"] = {"expert_bits": expert_bits, "expert_group_size": group_size}
  try:
    return cfg, from_dict(data)
  except ConfigError as err:
    raise ConfigError(f"--group-size {group_size}: {err}") from None


def _check_tokenizer(tokenizer_json: str | None, cfg: Config) -> None:
  if tokenizer_json is None:
    return
  tok = HFTokenizer(tokenizer_json, cfg.data.eos_id)
  if tok.vocab_size > cfg.model.vocab_size:
    raise UnsupportedModelError(f"the tokenizer has {tok.vocab_size} tokens, more than the "
                                f"model's vocab_size {cfg.model.vocab_size}")


def _fetcher(tensors: TensorSource, shapes: dict[str, tuple[int, ...]]):
  """fetch(name) -> the array, its shape checked against the one the config implies."""
  def fetch(name: str) -> np.ndarray:
    x = tensors.get(name)
    x = np.asarray(x() if callable(x) else x)
    if tuple(x.shape) != shapes[name]:
      raise TensorShapeError(f"tensor {name} has shape {tuple(x.shape)}; the config implies "
                             f"{shapes[name]}")
    return x
  return fetch


def _missing_dirs(path: Path) -> list[Path]:
  """path and its ancestors that do not exist yet, nearest first."""
  out = []
  while not path.exists():
    out.append(path)
    path = path.parent
  return out


def _check_shapes(tensors, shapes: dict[str, tuple[int, ...]]) -> None:
  """Up front, where the source can tell shapes without reading (safetensors headers)."""
  if not hasattr(tensors, "shape"):
    return
  for name, want in shapes.items():
    got = tuple(tensors.shape(name))
    if got != want:
      raise TensorShapeError(f"tensor {name} has shape {got}; the config implies {want}")


def write_params(cfg_float: Config, cfg_out: Config, tensors: TensorSource,
                 targets_: list[Target], shapes: dict, writer: ParamsWriter) -> int:
  """Builds the params of cfg_out's model target by target (module doc) and hands each
  target's arrays to `writer` as soon as they are built: the host holds one target plus the
  writer's pending piece, never the model. -> the number of parameters written."""
  like = {path: var.get_value() for path, var in nnx.to_flat_state(abstract_model(cfg_float)[1])}
  template = dict(nnx.to_flat_state(abstract_model(cfg_out)[1]))
  q = cfg_out.inference
  quantize = quantize_layer_experts(q.expert_bits, q.expert_group_size) if q.expert_bits != 16 else None
  cpu = jax.devices("cpu")[0]
  fetch = _fetcher(tensors, shapes)
  written = set()
  for target in targets_:
    built = target.build(fetch, like)
    layer = next(iter(built))[:-1]
    if quantize is not None and layer + (FLOAT_EXPERT_NAMES[0],) in built:
      built = {layer + (n,): v for n, v in quantize({p[-1]: v for p, v in built.items()}).items()}
    paths = list(built)
    if not set(paths) <= template.keys():
      raise ValueError(f"parameter trees differ: {sorted(set(paths) - template.keys())[:4]}")
    # Each host array is dropped as its CPU-device copy is made (a layer is held once, not
    # twice); fill_state checks shapes and dtypes against the model's.
    sub = nnx.from_flat_state({p: template[p] for p in paths})
    writer.add(fill_state(sub, {p: jax.device_put(built.pop(p), cpu) for p in paths}))
    written.update(paths)
  if written != set(template):
    raise ValueError(f"parameter trees differ: {sorted(set(template) - written)[:4]}")
  return int(sum(np.prod(v.get_value().shape) for v in template.values()))


def import_checkpoint(hf_config: dict, tensors: TensorSource, tokenizer_json: str | None,
                      out_dir: str | Path, *, dtype: str = "bfloat16", expert_bits: int = 16,
                      group_size: int = 128, source: str = "",
                      piece_bytes: int = PIECE_BYTES) -> dict:
  """Writes OUT_DIR, the moejax run of an HF checkpoint (module doc). tokenizer_json: the
  text of a Hugging Face tokenizer.json, or None (then eval / generate need
  data.tokenizer_file=PATH). piece_bytes: how many converted bytes are gathered before one
  orbax write (host memory against the number of writes). -> the summary also written to
  OUT_DIR/import.json."""
  out_dir = Path(out_dir)
  check_out_dir(out_dir)
  arch = architecture_of(hf_config)
  cfg_float, cfg_out = _configs(hf_config, out_dir, dtype, expert_bits, group_size)
  _check_tokenizer(tokenizer_json, cfg_out)
  keys = set(tensors.keys())
  targets_ = targets(cfg_float, arch, keys)
  check_names(cfg_float, targets_, keys)
  shapes = {name: shape for t in targets_ for name, shape in t.sources.items()}
  _check_shapes(tensors, shapes)

  # No buffers to write: router biases exist only with moe.bias_balancing, never imported.
  summary = {"run_dir": str(out_dir), "source": source, "architecture": arch,
             "dtype": dtype, "expert_bits": expert_bits,
             "expert_group_size": group_size if expert_bits != 16 else None,
             "tensors_read": len(shapes), "params": None,
             "tokenizer": HF_TOKENIZER_FILE if tokenizer_json is not None else None}

  made = _missing_dirs(out_dir.parent)
  out_dir.parent.mkdir(parents=True, exist_ok=True)
  tmp = out_dir.parent / f".{out_dir.name}.{uuid.uuid4().hex[:12]}.tmp"
  tmp.mkdir()
  try:
    save_config(cfg_out, tmp / "config.yaml")
    writer = ParamsWriter(tmp / "checkpoints", 0, cfg_out,
                          {"data_step": 0, "imported_from": source, "architecture": arch},
                          piece_bytes=piece_bytes)
    summary["params"] = write_params(cfg_float, cfg_out, tensors, targets_, shapes, writer)
    writer.close()
    if tokenizer_json is not None:
      write_atomic(tmp / HF_TOKENIZER_FILE, tokenizer_json)
    write_atomic(tmp / SUMMARY_FILE, json.dumps(summary, indent=2))
    if out_dir.is_dir():
      out_dir.rmdir()   # empty (checked above): rename needs the name free on every OS
    os.replace(tmp, out_dir)
  except BaseException:
    # A tensor read mid-way can still be refused (a source that cannot tell shapes up front):
    # leave nothing behind, not even the parent directories made for OUT_DIR.
    shutil.rmtree(made[-1] if made else tmp, ignore_errors=True)
    raise
  return summary
