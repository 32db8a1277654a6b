"""Config validation: `validate` raises a ConfigError naming the first impossible setting.
Called by config.from_dict, so every Config that is loaded or overridden has passed it."""
from __future__ import annotations

import dataclasses

from moejax.config import (ATTENTION_IMPLS, ELASTIC_ROUTING, EXCHANGES, EXPERT_BITS, REMATS,
                           Config, ConfigError, MoEConfig, is_moe_layer)
from moejax.config_offload import (OFFLOAD_HOST_MEMORY, OFFLOAD_POLICIES, OFFLOAD_PREDICTORS,
                                   OFFLOAD_TRANSFERS, offload_problem)

_CHOICES = {
    "model.dtype": ("float32", "bfloat16"),
    "model.param_dtype": ("float32", "bfloat16"),
    "moe.routing": ("softmax_topk", "topk_softmax", "top_p", "entropy"),
    "moe.expert_impl": ("dense", "ragged", "blocked", "gmm"),
    "data.corpus": ("shakespeare", "files"),
    "data.tokenizer": ("byte", "bpe", "hf"),
    "model.qk_norm": ("none", "head", "full"),
    "model.attention_impl": ATTENTION_IMPLS,
    "model.rope_scaling": ("none", "linear", "llama3"),
    "kv_cache.key_axis": ("channel", "token"),
    "kv_cache.value_axis": ("channel", "token"),
    "kv_cache.meta_dtype": ("float8_e4m3fn", "bfloat16", "float16"),
    "mesh.exchange": EXCHANGES,
    "train.remat": REMATS,
    "inference.offload.policy": OFFLOAD_POLICIES,
    "inference.offload.predictor": OFFLOAD_PREDICTORS,
    "inference.offload.host_memory": OFFLOAD_HOST_MEMORY,
    "inference.offload.transfer": OFFLOAD_TRANSFERS,
}


def validate(cfg: Config) -> None:
  """Raises ConfigError naming the first impossible setting."""
  m, e, d, t, kv = cfg.model, cfg.moe, cfg.data, cfg.train, cfg.kv_cache
  for section, obj in (("model", m), ("moe", e), ("data", d), ("train", t), ("kv_cache", kv),
                       ("mesh", cfg.mesh), ("inference", cfg.inference),
                       ("inference.offload", cfg.inference.offload)):
    for f in dataclasses.fields(obj):
      choice = _CHOICES.get(f"{section}.{f.name}")
      value = getattr(obj, f.name)
      if choice and value not in choice:
        raise ConfigError(f"{section}.{f.name}={value!r}: must be one of {', '.join(choice)}")
  positive = {
      "model.vocab_size": m.vocab_size, "model.d_model": m.d_model, "model.num_layers": m.num_layers,
      "model.num_heads": m.num_heads, "model.num_kv_heads": m.num_kv_heads,
      "model.head_dim": m.head_dim, "model.ffn_hidden": m.ffn_hidden,
      "model.max_seq_len": m.max_seq_len, "moe.num_experts": e.num_experts, "moe.top_k": e.top_k,
      "moe.expert_hidden": e.expert_hidden, "moe.moe_every": e.moe_every, "moe.max_k": e.max_k,
      "data.seq_len": d.seq_len, "data.batch_size": d.batch_size, "train.steps": t.steps,
      "train.log_every": t.log_every, "train.eval_every": t.eval_every,
      "train.checkpoint_every": t.checkpoint_every, "train.keep_checkpoints": t.keep_checkpoints,
      "kv_cache.group_size": kv.group_size,
  }
  for name, value in positive.items():
    if value <= 0:
      raise ConfigError(f"{name}={value}: must be positive")
  if m.num_heads % m.num_kv_heads:
    raise ConfigError(
        f"model.num_heads={m.num_heads} must be a multiple of model.num_kv_heads={m.num_kv_heads}")
  if m.head_dim % 2:
    raise ConfigError(f"model.head_dim={m.head_dim} must be even (rotary embeddings rotate pairs)")
  if e.top_k > e.num_experts:
    raise ConfigError(f"moe.top_k={e.top_k} exceeds moe.num_experts={e.num_experts}")
  _validate_elastic_routing(e)
  for name, value in (("moe.num_shared_experts", e.num_shared_experts),
                      ("moe.shared_expert_hidden", e.shared_expert_hidden),
                      ("moe.first_dense_layers", e.first_dense_layers),
                      ("moe.capacity_factor", e.capacity_factor),
                      ("moe.aux_loss_coef", e.aux_loss_coef), ("moe.z_loss_coef", e.z_loss_coef),
                      ("model.clip_qkv", m.clip_qkv),
                      ("train.warmup_steps", t.warmup_steps), ("train.weight_decay", t.weight_decay),
                      ("train.grad_clip", t.grad_clip), ("kv_cache.residual_window", kv.residual_window),
                      ("kv_cache.sink_tokens", kv.sink_tokens)):
    if value < 0:
      raise ConfigError(f"{name}={value}: must be >= 0")
  if m.rope_scaling != "none" and m.rope_factor < 1.0:
    raise ConfigError(f"model.rope_factor={m.rope_factor}: must be >= 1 with rope_scaling "
                      f"{m.rope_scaling}")
  if m.rope_scaling == "llama3" and not (0 < m.rope_low_freq_factor < m.rope_high_freq_factor):
    raise ConfigError("model.rope_low_freq_factor / rope_high_freq_factor: need "
                      "0 < low < high for rope_scaling llama3")
  for i in e.dense_layers:
    if not 0 <= i < m.num_layers:
      raise ConfigError(f"moe.dense_layers: layer {i} is not in [0, {m.num_layers})")
  if e.shared_expert_gate and not e.num_shared_experts:
    raise ConfigError("moe.shared_expert_gate=true needs moe.num_shared_experts >= 1")
  if d.seq_len > m.max_seq_len:
    raise ConfigError(f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
  if d.tokenizer == "byte" and m.vocab_size < 256:
    raise ConfigError(f"model.vocab_size={m.vocab_size}: the byte tokenizer needs at least 256")
  if d.tokenizer == "bpe" and d.bpe_vocab_size > m.vocab_size:
    raise ConfigError(
        f"data.bpe_vocab_size={d.bpe_vocab_size} exceeds model.vocab_size={m.vocab_size}")
  if d.corpus == "files" and not d.files:
    raise ConfigError("data.corpus=files needs data.files (a list of globs)")
  if not (0.0 < d.val_fraction < 1.0):
    raise ConfigError(f"data.val_fraction={d.val_fraction}: must be in (0, 1)")
  if not (0.0 < t.min_lr_ratio <= 1.0) or t.lr <= 0:
    raise ConfigError(f"train.lr={t.lr} / train.min_lr_ratio={t.min_lr_ratio}: lr > 0, ratio in (0, 1]")
  if kv.bits not in (2, 3, 4, 8, 16):
    raise ConfigError(f"kv_cache.bits={kv.bits}: must be one of 2, 3, 4, 8, 16")
  for i, b in enumerate(kv.layer_bits):
    if b not in (2, 3, 4, 8, 16):
      raise ConfigError(f"kv_cache.layer_bits[{i}]={b}: must be one of 2, 3, 4, 8, 16")
  if kv.layer_bits and len(kv.layer_bits) != m.num_layers:
    raise ConfigError(f"kv_cache.layer_bits has {len(kv.layer_bits)} entries for "
                      f"{m.num_layers} layers")
  if kv.group_size < 16 or kv.group_size & (kv.group_size - 1):
    raise ConfigError(f"kv_cache.group_size={kv.group_size}: must be a power of two >= 16")
  if kv.residual_window % kv.group_size:
    raise ConfigError(f"kv_cache.residual_window={kv.residual_window} must be a multiple of "
                      f"kv_cache.group_size={kv.group_size} (the window is flushed in whole groups)")
  if not (0.0 <= kv.outlier_fraction < 1.0):
    raise ConfigError(f"kv_cache.outlier_fraction={kv.outlier_fraction}: must be in [0, 1)")
  for name, value in (("mesh.data", cfg.mesh.data), ("mesh.expert", cfg.mesh.expert),
                      ("mesh.model", cfg.mesh.model)):
    if value == 0 or value < -1:
      raise ConfigError(f"{name}={value}: must be positive or -1 (all remaining devices)")
  if cfg.mesh.expert > 0 and e.num_experts % cfg.mesh.expert:
    raise ConfigError(
        f"mesh.expert={cfg.mesh.expert} does not divide moe.num_experts={e.num_experts}")
  _validate_inference(cfg)


def _validate_elastic_routing(e: MoEConfig) -> None:
  """top_p / entropy routing: their thresholds and K = max_k slots."""
  if e.routing == "top_p" and not (0.0 < e.top_p <= 1.0):
    raise ConfigError(f"moe.top_p={e.top_p}: must be in (0, 1]")
  if e.routing == "entropy":
    if not (0.0 <= e.entropy_threshold < 1.0):
      raise ConfigError(f"moe.entropy_threshold={e.entropy_threshold}: must be in [0, 1) "
                        "(a normalized router entropy; at or below it a token takes min_k "
                        "experts)")
    if not (1 <= e.min_k <= e.max_k):
      raise ConfigError(f"moe.min_k={e.min_k}: must be in [1, moe.max_k={e.max_k}]")
  if e.routing in ELASTIC_ROUTING and e.max_k > e.num_experts:
    raise ConfigError(f"moe.max_k={e.max_k} exceeds moe.num_experts={e.num_experts}")


def _validate_inference(cfg: Config) -> None:
  """Quantized experts: the widths each scale group spans must split evenly (quantize_expert_
  weights' rules: int4 packs the contraction rows in two halves, groups span a half)."""
  q = cfg.inference
  _validate_offload(cfg)
  if q.expert_bits not in EXPERT_BITS:
    raise ConfigError(f"inference.expert_bits={q.expert_bits}: must be one of 16 (float), "
                      "8 or 4 (quantized)")
  if q.expert_group_size < 0:
    raise ConfigError(f"inference.expert_group_size={q.expert_group_size}: must be >= 0 "
                      "(0: one scale per output channel)")
  if q.expert_bits == 16:
    return
  widths = {"model.d_model": cfg.model.d_model, "moe.expert_hidden": cfg.moe.expert_hidden}
  for name, width in widths.items():
    if q.expert_bits == 4 and width % 2:
      raise ConfigError(f"{name}={width} must be even for inference.expert_bits=4 (int4 packs "
                        "two rows per byte)")
    span = width // 2 if q.expert_bits == 4 else width
    if q.expert_group_size and span % q.expert_group_size:
      what = f"{name}/2={span}" if q.expert_bits == 4 else f"{name}={width}"
      raise ConfigError(f"inference.expert_group_size={q.expert_group_size} must divide {what} "
                        f"(the rows one scale group spans at {q.expert_bits} bits), or be 0")


def _validate_offload(cfg: Config) -> None:
  L = cfg.model.num_layers
  problem = offload_problem(cfg.inference.offload, L, sum(is_moe_layer(cfg, i) for i in range(L)),
                            cfg.moe.num_experts)
  if problem:
    raise ConfigError(problem)
