"""Configuration schema: frozen dataclasses, loaded from YAML, overridden by `key.sub=value`.

The dataclasses below are the schema and the single place where defaults live. YAML
files under configs/ are data; unknown keys are errors that name the key and
suggest the closest known one.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

import yaml

from moejax.atomic import write_atomic
from moejax.config_offload import (OFFLOAD_HOST_MEMORY, OFFLOAD_POLICIES,  # noqa: F401
                                   OFFLOAD_PREDICTORS, OFFLOAD_TRANSFERS, OffloadConfig)


class ConfigError(ValueError):
  """A config value or key that cannot be used; the message says which."""


# mesh.exchange, the dropless expert-parallel token exchange (parallel/dispatch.py). auto:
# ragged_all_to_all where XLA has it (GPU, TPU), else the padded all_to_all stand-in.
EXCHANGES = ("auto", "ragged", "padded")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = 256
  d_model: int = 128
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 32
  ffn_hidden: int = 512          # hidden size of dense (non-MoE) SwiGLU layers
  max_seq_len: int = 256
  rope_theta: float = 10000.0
  norm_eps: float = 1e-6
  tie_embeddings: bool = True
  qkv_bias: bool = False         # q, k, v projections have biases (Qwen2)
  qk_norm: str = "none"          # none | head: RMSNorm of each head's A channels (Qwen3) |
                                 # full: RMSNorm over the whole q / k projection (OLMoE)
  clip_qkv: float = 0.0          # > 0: clamp q, k, v to [-clip, clip] after projection (OLMoE)
  rope_scaling: str = "none"     # none | linear | llama3 (Llama 3.1 frequency bands)
  rope_factor: float = 1.0       # linear / llama3: the context extension factor
  rope_low_freq_factor: float = 1.0    # llama3: wavelengths above orig_len / low are scaled
  rope_high_freq_factor: float = 4.0   # llama3: wavelengths below orig_len / high are kept
  rope_original_max_len: int = 8192    # llama3: the pre-extension context length
  dtype: str = "float32"         # compute dtype: float32 | bfloat16
  param_dtype: str = "float32"   # parameter storage dtype
  init_std: float = 0.02
  scan_layers: bool = False      # training forward: runs of same-structure blocks as one
                                 # lax.scan (one compiled block per run); layout unchanged
  attention_impl: str = "auto"   # causal attention without a cache: xla (einsums) | cudnn
                                 # (flash) | auto (cudnn on GPU in bf16 / f16, else xla)


# moe.routing modes that pick a per-token number of experts, in K = max_k static slots.
ELASTIC_ROUTING = ("top_p", "entropy")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  num_experts: int = 8
  top_k: int = 2
  expert_hidden: int = 256
  num_shared_experts: int = 0
  shared_expert_hidden: int = 0  # 0: same as expert_hidden
  shared_expert_gate: bool = False  # scale the shared experts' output by sigmoid(x @ w_D)
                                    # (Qwen2-MoE)
  first_dense_layers: int = 0    # the first N layers use a dense FFN
  moe_every: int = 1             # after those, every N-th layer is MoE (others dense)
  dense_layers: tuple[int, ...] = ()  # these layers use a dense FFN too (Qwen mlp_only_layers)
  routing: str = "softmax_topk"  # softmax_topk (Mixtral) | topk_softmax | top_p | entropy
  renormalize: bool = True       # renormalize the selected weights to sum to 1
  top_p: float = 0.9             # top_p routing: take experts until cumulative prob >= p ...
  max_k: int = 4                 # ... capped at max_k experts (top_p, entropy)
  # entropy routing: h = H(router probs) / log E in [0, 1]; a token takes
  # k = min_k + ceil((max_k - min_k) * max(h - threshold, 0) / (1 - threshold)) experts:
  # min_k while confident (h <= threshold), max_k for a uniform router (routing.entropy_k).
  min_k: int = 1
  entropy_threshold: float = 0.5
  capacity_factor: float = 0.0   # 0: dropless; >0: capacity = ceil(cf * tokens * k / E)
  expert_impl: str = "ragged"    # dense | ragged | blocked | gmm
  aux_loss_coef: float = 0.01    # Switch load-balancing loss
  z_loss_coef: float = 0.001     # router z-loss
  bias_balancing: bool = False   # DeepSeek-V3 auxiliary-loss-free bias (selection only)
  bias_update_rate: float = 0.001


@dataclasses.dataclass(frozen=True)
class DataConfig:
  corpus: str = "shakespeare"    # shakespeare | files
  files: tuple[str, ...] = ()    # globs of training text files (corpus: files)
  val_files: tuple[str, ...] = ()  # globs of validation files; empty: split off val_fraction
  val_fraction: float = 0.1
  tokenizer: str = "byte"        # byte | bpe | hf (a Hugging Face tokenizer.json)
  tokenizer_file: str = ""       # hf: the tokenizer.json to copy into a new run directory
  eos_id: int = -1               # hf: end-of-text id, a stop token for generation; -1: none
  bpe_vocab_size: int = 2048
  seq_len: int = 128
  batch_size: int = 16


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 1000
  lr: float = 3e-3
  min_lr_ratio: float = 0.1
  warmup_steps: int = 50
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  grad_clip: float = 1.0
  seed: int = 0
  log_every: int = 10
  eval_every: int = 200
  eval_batches: int = 8
  checkpoint_every: int = 200
  keep_checkpoints: int = 3
  out_dir: str = "runs/tiny"
  tensorboard: bool = False      # also TensorBoard event files in out_dir/tb (tensorboardX:
                                 # the `tensorboard` extra)
  remat: str = "none"            # none | experts (recompute the routed experts' FFN in the
                                 # backward) | full (recompute each block)


@dataclasses.dataclass(frozen=True)
class KVCacheConfig:
  bits: int = 16                 # 16: bf16 cache; 2 | 3 | 4 | 8: quantized
  group_size: int = 32
  outlier_fraction: float = 0.0
  residual_window: int = 32
  sink_tokens: int = 0
  key_axis: str = "channel"      # keys: per-channel statistics over G tokens (KIVI)
  value_axis: str = "token"      # values: per-token statistics over G channels
  meta_dtype: str = "float8_e4m3fn"  # scales / zero-points: float8_e4m3fn | bfloat16 | float16
  layer_bits: tuple[int, ...] = ()   # per-layer override of `bits` (empty: all layers use bits)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = -1                 # -1: all remaining devices
  expert: int = 1
  model: int = 1
  fsdp: bool = False             # also shard non-expert weights (embed dim) along `data`
  exchange: str = "auto"         # dropless EP token exchange: auto | ragged | padded


# train.remat: what the training backward recomputes instead of storing (model/transformer.py).
REMATS = ("none", "experts", "full")
ATTENTION_IMPLS = ("auto", "xla", "cudnn")


# inference.expert_bits: 16 keeps the training layout (w_gate_EDF, w_up_EDF, w_down_EFD);
# 8 | 4 hold every MoE layer's routed experts as int8 / packed int4 codes + float32 scales.
EXPERT_BITS = (16, 8, 4)


@dataclasses.dataclass(frozen=True)
class InferenceConfig:
  expert_bits: int = 16          # 16: float experts (trainable); 8 | 4: quantized (eval, generate)
  expert_group_size: int = 128   # one scale per this many rows of the contraction dim (D for
                                 # gate|up, F for down); 0: one scale per output channel
  offload: OffloadConfig = OffloadConfig()


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = ModelConfig()
  moe: MoEConfig = MoEConfig()
  data: DataConfig = DataConfig()
  train: TrainConfig = TrainConfig()
  kv_cache: KVCacheConfig = KVCacheConfig()
  mesh: MeshConfig = MeshConfig()
  inference: InferenceConfig = InferenceConfig()

  def to_dict(self) -> dict[str, Any]:
    return _to_plain(dataclasses.asdict(self))


# ---------------------------------------------------------------- loading ---

def _to_plain(obj):
  if isinstance(obj, dict):
    return {k: _to_plain(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_to_plain(v) for v in obj]
  return obj


def _suggest(key: str, known: list[str]) -> str:
  close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
  return f" (did you mean '{close[0]}'?)" if close else f" (known keys: {', '.join(sorted(known))})"


def _coerce(value: Any, tp: Any, where: str) -> Any:
  """Converts a YAML/CLI value to the field's declared type, or raises ConfigError."""
  origin = typing.get_origin(tp)
  if origin is tuple:
    if isinstance(value, str):
      value = [v for v in value.split(",") if v]
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f"{where}: expected a list, got {value!r}")
    (item_tp, _) = typing.get_args(tp)
    return tuple(_coerce(v, item_tp, where) for v in value)
  if tp is bool:
    if isinstance(value, bool):
      return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
      return value.lower() in ("true", "1", "yes")
    raise ConfigError(f"{where}: expected true/false, got {value!r}")
  if tp is int:
    if isinstance(value, bool):
      raise ConfigError(f"{where}: expected an integer, got {value!r}")
    try:
      f = float(value)
    except (TypeError, ValueError):
      raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if not f.is_integer():
      raise ConfigError(f"{where}: expected an integer, got {value!r}")
    return int(f)
  if tp is float:
    try:
      return float(value)
    except (TypeError, ValueError):
      raise ConfigError(f"{where}: expected a number, got {value!r}") from None
  if tp is str:
    if isinstance(value, (dict, list)):
      raise ConfigError(f"{where}: expected a string, got {value!r}")
    return str(value)
  raise ConfigError(f"{where}: unsupported type {tp}")


def _build(cls, data: dict[str, Any], where: str):
  if not isinstance(data, dict):
    raise ConfigError(f"{where or 'config'}: expected a mapping, got {data!r}")
  hints = typing.get_type_hints(cls)
  fields = {f.name: f for f in dataclasses.fields(cls)}
  kwargs = {}
  for key, value in data.items():
    path = f"{where}.{key}" if where else key
    if key not in fields:
      raise ConfigError(f"unknown config key '{path}'{_suggest(key, list(fields))}")
    tp = hints[key]
    if dataclasses.is_dataclass(tp):
      kwargs[key] = _build(tp, value or {}, path)
    else:
      kwargs[key] = _coerce(value, tp, path)
  return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
  parts = dotted.split(".")
  node = tree
  for p in parts[:-1]:
    node = node.setdefault(p, {})
    if not isinstance(node, dict):
      raise ConfigError(f"override '{dotted}': '{p}' is not a section")
  node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
  """['moe.top_k=4', 'train.steps=10'] -> nested dict; values parsed as YAML scalars."""
  tree: dict[str, Any] = {}
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"override '{item}' must look like key.sub=value")
    key, raw = item.split("=", 1)
    try:
      value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as err:
      raise ConfigError(f"override '{item}': the value is not valid YAML ({_yaml_problem(err)})"
                        ) from None
    _set_dotted(tree, key.strip(), value)
  return tree


def _merge(base: dict, extra: dict) -> dict:
  out = dict(base)
  for k, v in extra.items():
    out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
  return out


def from_dict(data: dict[str, Any]) -> Config:
  from moejax.config_checks import validate   # it imports this module's classes
  cfg = _build(Config, data or {}, "")
  validate(cfg)
  return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
  """Reads a YAML config (or the defaults when path is None) and applies overrides."""
  data: dict[str, Any] = {}
  if path is not None:
    path = Path(path)
    if not path.is_file():
      raise ConfigError(f"config file not found: {path}")
    try:
      data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
      mark = getattr(err, "problem_mark", None)
      where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
      raise ConfigError(f"{where}: invalid YAML: {_yaml_problem(err)}") from None
  if overrides:
    data = _merge(data, parse_overrides(overrides))
  return from_dict(data)


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
  """cfg with `key.sub=value` overrides applied (and validated)."""
  return from_dict(_merge(cfg.to_dict(), parse_overrides(overrides))) if overrides else cfg


def _yaml_problem(err: yaml.YAMLError) -> str:
  """The one-line reason of a YAML error (its str() spans lines and names "<unicode string>")."""
  return " ".join(str(x) for x in (getattr(err, "context", None), getattr(err, "problem", None))
                  if x) or str(err).splitlines()[0]


def save_config(cfg: Config, path: str | Path) -> None:
  write_atomic(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def is_moe_layer(cfg: Config, layer: int) -> bool:
  """Layer i is MoE when past first_dense_layers, on the moe_every stride and not one of
  moe.dense_layers."""
  e = cfg.moe
  return (layer >= e.first_dense_layers and (layer - e.first_dense_layers) % e.moe_every == 0
          and layer not in e.dense_layers)

