"""`moejax quantize`: a trained run's routed expert weights to int8 / int4, written as a new
run directory that `moejax eval` and `generate` load like any run.

The output holds config.yaml (inference.expert_bits / expert_group_size set), a params-only
checkpoint at the source's step (Checkpointer.save_params: it can be evaluated, not
resumed), the tokenizer model if the run has one, and quantize.json (bytes before and
after). It is written into a temporary sibling directory and renamed into place, so OUT_DIR
is either absent (a refusal or a failure) or complete. Every refusal happens before anything
is written. Layer by layer: beyond the restored float checkpoint, only one MoE layer's
experts exist in float32 at a time (and each is freed once quantized).
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

from flax import nnx
from pallas_kernels import QuantizedExpertWeights

from moejax.atomic import write_atomic
from moejax.checkpoint import Checkpointer, load_run_config
from moejax.config import Config, ConfigError, from_dict, is_moe_layer, save_config
from moejax.model.layers import dtype_of
from moejax.model.moe import (FLOAT_EXPERT_NAMES, QUANTIZED_EXPERT_NAMES, dequantize_experts,
                              quantize_experts)
from moejax.run_io import TOKENIZER_FILES
from moejax.state import abstract_model, fill_state

SUMMARY_FILE = "quantize.json"
QUANTIZED_BITS = (8, 4)

StatePath = tuple   # an nnx state path, e.g. ("blocks", 1, "ffn", "w_gate_EDF")


def moe_layer_paths(cfg: Config) -> list[StatePath]:
  """The state path of every MoE layer's expert module."""
  return [("blocks", i, "ffn") for i in range(cfg.model.num_layers) if is_moe_layer(cfg, i)]


def _flat_values(state) -> dict[StatePath, object]:
  return {path: var.get_value() for path, var in nnx.to_flat_state(state)}


def _rebuild(template, source: dict[StatePath, object], layers: list[StatePath], from_names,
             convert_layer: Callable[[dict], dict]):
  """The state of `template` (abstract) from `source` (flat values of the other layout).
  Each layer's experts are popped from `source` and converted in turn, so when the caller
  holds no other reference, each float layer is freed once converted."""
  out = {}
  for layer in layers:
    converted = convert_layer({name: source.pop(layer + (name,)) for name in from_names})
    out.update({layer + (name,): value for name, value in converted.items()})
  out.update(source)   # everything outside the routed experts is shared as is
  return fill_state(template, out)


def quantize_layer_experts(bits: int, group_size: int):
  """-> convert(one MoE layer's float experts by FLOAT_EXPERT_NAMES) -> its codes and scales
  by QUANTIZED_EXPERT_NAMES (also what `moejax import --expert-bits` runs per layer)."""
  def convert(w: dict) -> dict:
    gate_up, down = quantize_experts(*(w[n] for n in FLOAT_EXPERT_NAMES), bits, group_size)
    return dict(zip(QUANTIZED_EXPERT_NAMES, (gate_up.codes, gate_up.scales, down.codes,
                                             down.scales)))
  return convert


def quantized_layer_weights(cfg: Config, layer_params: dict
                            ) -> tuple[QuantizedExpertWeights, QuantizedExpertWeights]:
  """(gate|up, down) QuantizedExpertWeights of one MoE layer's quantized params (by name)."""
  q = cfg.inference
  codes_scales = [layer_params[n] for n in QUANTIZED_EXPERT_NAMES]
  return tuple(QuantizedExpertWeights(c, s, q.expert_bits, q.expert_group_size or None)
               for c, s in (codes_scales[:2], codes_scales[2:]))


def quantize_params(cfg_quantized: Config, params):
  """A 16-bit model's params -> the params of the model of `cfg_quantized` (same model, its
  inference.expert_bits 8 or 4), one MoE layer at a time."""
  q = cfg_quantized.inference
  return _rebuild(abstract_model(cfg_quantized)[1], _flat_values(params),
                  moe_layer_paths(cfg_quantized), FLOAT_EXPERT_NAMES,
                  quantize_layer_experts(q.expert_bits, q.expert_group_size))


def dequantize_params(cfg_float: Config, cfg_quantized: Config, params):
  """The inverse layout: quantized params -> the 16-bit model of `cfg_float` holding the
  dequantized weights (the same numbers, in model.param_dtype)."""
  dtype = dtype_of(cfg_float.model.param_dtype)

  def convert(w: dict) -> dict:
    return dict(zip(FLOAT_EXPERT_NAMES,
                    dequantize_experts(*quantized_layer_weights(cfg_quantized, w), dtype)))
  return _rebuild(abstract_model(cfg_float)[1], _flat_values(params),
                  moe_layer_paths(cfg_float), QUANTIZED_EXPERT_NAMES, convert)


def expert_nbytes(cfg: Config, params) -> int:
  """Bytes of every MoE layer's routed expert arrays (codes + scales when quantized)."""
  flat = _flat_values(params)
  if cfg.inference.expert_bits != 16:
    return sum(w.nbytes for layer in moe_layer_paths(cfg) for w in quantized_layer_weights(
        cfg, {n: flat[layer + (n,)] for n in QUANTIZED_EXPERT_NAMES}))
  return sum(int(flat[layer + (n,)].nbytes) for layer in moe_layer_paths(cfg)
             for n in FLOAT_EXPERT_NAMES)


def expert_nbytes_16bit(cfg: Config) -> int:
  """Bytes the routed experts take in bf16: the reference for the quantized sizes."""
  e, d, f = cfg.moe.num_experts, cfg.model.d_model, cfg.moe.expert_hidden
  return len(moe_layer_paths(cfg)) * 3 * e * d * f * 2


def _check_request(run_dir: Path, out_dir: Path, expert_bits: int) -> Config:
  """Every refusal, before anything is read into memory or written. -> the run's config."""
  if expert_bits not in QUANTIZED_BITS:
    raise ValueError(f"--expert-bits {expert_bits}: must be 8 or 4 (16 is the unquantized "
                     "model: use the run itself)")
  if not (run_dir / "checkpoints").is_dir():
    raise FileNotFoundError(f"{run_dir} is not a run directory (no checkpoints/ inside)")
  if out_dir.resolve() == run_dir.resolve():
    raise ValueError(f"OUT_DIR is RUN_DIR ({run_dir}): write the quantized run to a new "
                     "directory")
  if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
    raise ValueError(f"{out_dir} already exists and is not an empty directory; choose a new "
                     "OUT_DIR")
  cfg = load_run_config(run_dir)   # FileNotFoundError when checkpoints/ holds none
  if cfg.inference.expert_bits != 16:
    raise ValueError(f"{run_dir} is already quantized (inference.expert_bits="
                     f"{cfg.inference.expert_bits}); quantize the 16-bit run it came from")
  if not moe_layer_paths(cfg):
    raise ValueError(f"{run_dir}: the model has no MoE layers, so no expert weights to "
                     "quantize")
  return cfg


def quantize_run(run_dir: str | Path, out_dir: str | Path, expert_bits: int,
                 group_size: int = 128) -> dict:
  """Writes OUT_DIR, the run of RUN_DIR's latest checkpoint with its experts quantized to
  `expert_bits` (8 | 4) with `group_size` rows per scale (0: per output channel).
  -> the summary also written to OUT_DIR/quantize.json."""
  run_dir, out_dir = Path(run_dir), Path(out_dir)
  cfg = _check_request(run_dir, out_dir, expert_bits)
  data = cfg.to_dict()
  data["inference"] = {"expert_bits": expert_bits, "expert_group_size": group_size}
  data["train"]["out_dir"] = str(out_dir)
  try:
    cfg_q = from_dict(data)
  except ConfigError as err:
    raise ConfigError(f"--group-size {group_size}: {err}") from None

  _, params, buffers = abstract_model(cfg)
  params, buffers, meta = Checkpointer(run_dir / "checkpoints").restore_params(
      params, buffers, cfg)
  step = int(meta["step"])
  bytes_before = expert_nbytes(cfg, params)
  source = _flat_values(params)
  del params   # `source` now holds the only reference: each float layer is freed once quantized
  params_q = _rebuild(abstract_model(cfg_q)[1], source, moe_layer_paths(cfg_q),
                      FLOAT_EXPERT_NAMES, quantize_layer_experts(expert_bits, group_size))
  summary = {"run_dir": str(out_dir), "source": str(run_dir), "step": step,
             "expert_bits": expert_bits, "expert_group_size": group_size,
             "moe_layers": len(moe_layer_paths(cfg_q)), "expert_bytes_source": bytes_before,
             "expert_bytes_16bit": expert_nbytes_16bit(cfg),
             "expert_bytes": expert_nbytes(cfg_q, params_q)}

  out_dir.parent.mkdir(parents=True, exist_ok=True)
  tmp = out_dir.parent / f".{out_dir.name}.{uuid.uuid4().hex[:12]}.tmp"
  tmp.mkdir()   # not mkdtemp: the run directory gets the umask's permissions, like train's
  try:
    save_config(cfg_q, tmp / "config.yaml")
    ckpt = Checkpointer(tmp / "checkpoints", keep=1)
    ckpt.save_params(step, params_q, buffers, cfg_q,
                     {"data_step": meta.get("data_step", step), "quantized_from": str(run_dir)})
    ckpt.close()
    for name in TOKENIZER_FILES:
      if (run_dir / name).is_file():
        shutil.copy2(run_dir / name, tmp / name)
    write_atomic(tmp / SUMMARY_FILE, json.dumps(summary, indent=2))
    if out_dir.is_dir():
      out_dir.rmdir()   # empty (checked above): rename needs the name free on every OS
    os.replace(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return summary
