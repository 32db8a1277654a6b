"""`moejax import SRC OUT_DIR`'s front ends: a Hugging Face model folder (config.json,
model.safetensors or shards named by model.safetensors.index.json, tokenizer.json) read
tensor by tensor, or a .gguf file (convert/gguf.py); both end in importer.import_checkpoint."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np

from moejax.convert.importer import check_out_dir, import_checkpoint

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class SafetensorsSource:
  """HF-named tensors of one or several .safetensors files, read one at a time
  (safetensors.safe_open: each get reads that tensor only). Also a context manager."""

  def __init__(self, files_by_name: dict[str, Path]):
    from safetensors import safe_open   # imported here: only `moejax import` needs it
    self._stack = contextlib.ExitStack()
    handles = {f: self._stack.enter_context(safe_open(str(f), framework="np"))
               for f in sorted(set(files_by_name.values()))}
    self._handle = {name: handles[f] for name, f in files_by_name.items()}
    self._file = files_by_name

  @classmethod
  def from_folder(cls, folder: Path) -> "SafetensorsSource":
    from safetensors import safe_open
    index = folder / INDEX_FILE
    if index.is_file():
      weight_map = json.loads(index.read_text())["weight_map"]
      files = {name: folder / shard for name, shard in weight_map.items()}
      for shard in sorted(set(files.values())):
        if not shard.is_file():
          raise FileNotFoundError(f"{index} names shard {shard.name}, which is missing")
      return cls(files)
    shards = [folder / SINGLE_FILE] if (folder / SINGLE_FILE).is_file() else sorted(
        folder.glob("*.safetensors"))
    if not shards:
      bins = sorted(p.name for p in folder.glob("*.bin"))
      raise FileNotFoundError(f"{folder}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors"
                              + (f" (found {', '.join(bins[:2])}: PyTorch pickles are not "
                                 "read; save the model with safetensors)" if bins else ""))
    files = {}
    for shard in shards:
      with safe_open(str(shard), framework="np") as f:
        files.update({name: shard for name in f.keys()})
    return cls(files)

  def keys(self):
    return self._file.keys()

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._handle[name].get_slice(name).get_shape())

  def get(self, name: str) -> np.ndarray:
    handle = self._handle[name]
    if handle.get_slice(name).get_dtype() in _NUMPY_LACKS:
      return _read_raw(self._file[name], name)
    return handle.get_tensor(name)

  def close(self):
    self._stack.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


# safetensors' numpy reader cannot make these; they are read from the file directly.
_NUMPY_LACKS = {"BF16", "F8_E4M3", "F8_E5M2"}


def _read_raw(path: Path, name: str) -> np.ndarray:
  """One tensor read from its byte range (the format: u64 header size, JSON header, data)."""
  import ml_dtypes
  dtypes = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
            "F8_E5M2": ml_dtypes.float8_e5m2}
  with open(path, "rb") as f:
    header_len = int.from_bytes(f.read(8), "little")
    info = json.loads(f.read(header_len))[name]
    start, end = info["data_offsets"]
    f.seek(8 + header_len + start)
    data = f.read(end - start)
  return np.frombuffer(data, dtypes[info["dtype"]]).reshape(info["shape"])


def read_hf_folder(src: Path) -> tuple[dict, SafetensorsSource, str | None]:
  """(config.json dict, its tensors, tokenizer.json text or None) of an HF model folder."""
  if not src.is_dir():
    raise FileNotFoundError(f"{src}: no such directory (SRC is a Hugging Face model folder "
                            "or a .gguf file)")
  config = src / "config.json"
  if not config.is_file():
    raise FileNotFoundError(f"{src}: no config.json (not a Hugging Face model folder)")
  tokenizer = src / "tokenizer.json"
  tokenizer_json = tokenizer.read_text(encoding="utf-8") if tokenizer.is_file() else None
  return json.loads(config.read_text()), SafetensorsSource.from_folder(src), tokenizer_json


def import_model(src: str | Path, out_dir: str | Path, *, dtype: str = "bfloat16",
                 expert_bits: int = 16, group_size: int = 128) -> dict:
  """`moejax import`: SRC an HF model folder or a .gguf file -> the run OUT_DIR."""
  src, out_dir = Path(src), Path(out_dir)
  check_out_dir(out_dir)
  if src.suffix == ".gguf":
    if not src.is_file():
      raise FileNotFoundError(f"{src}: no such file")
    from moejax.convert.gguf import read_gguf   # only GGUF imports need the gguf package
    tensors = read_gguf(src)   # HF names and layouts, dequantized one tensor at a time
    hf_config, tokenizer_json = tensors.hf_config, tensors.tokenizer_json
  else:
    hf_config, tensors, tokenizer_json = read_hf_folder(src)
  try:
    summary = import_checkpoint(hf_config, tensors, tokenizer_json, out_dir, dtype=dtype,
                                expert_bits=expert_bits, group_size=group_size, source=str(src))
  finally:
    close = getattr(tensors, "close", None)
    if close is not None:
      close()
  if tokenizer_json is None:
    summary["note"] = (f"{src} has no tokenizer.json: pass data.tokenizer_file=PATH to eval "
                       "and generate")
  return summary
