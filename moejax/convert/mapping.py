"""Hugging Face architectures -> moejax: the config translation and, per moejax parameter,
which HF tensors make it and how (transposes, expert stacking).

HF linear weights are [out, in] (y = x W^T); moejax's are [in, out] (y = x W): every
projection is transposed. HF's rotary embedding is rotate_half (channels c and c + A/2
pair up), which is moejax's `rope`, so q/k rows need no permutation. Experts come in two
namings, both accepted per layer:
  per expert  {p}.experts.{j}.{w1,w3,w2}.weight (Mixtral) or .{gate,up,down}_proj.weight,
              each [F, D] (gate, up) / [D, F] (down);
  fused       {p}.experts.gate_up_proj [E, 2F, D] (gate rows first), {p}.experts.down_proj
              [E, D, F] (transformers 5's in-memory layout).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from moejax.config import Config, ConfigError, from_dict, is_moe_layer

ARCHITECTURES = ("LlamaForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM",
                 "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# Tensors a checkpoint may hold that the model does not read (recomputed buffers).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

Path_ = tuple                        # an nnx state path, e.g. ("blocks", 0, "attn", "wq_DHd")
Fetch = Callable[[str], np.ndarray]  # HF name -> its array, shape already checked


class UnsupportedModelError(ValueError):
  """The checkpoint's architecture, a setting or a tensor that moejax cannot represent."""


@dataclasses.dataclass(frozen=True)
class Target:
  """moejax parameters built from HF tensors: `sources` (name -> the shape the config
  implies) are all read by `build(fetch, like)` -> {path: array}; `like` gives each path's
  target shape and dtype."""
  sources: dict[str, tuple[int, ...]]
  build: Callable[[Fetch, dict], dict[Path_, np.ndarray]]


# config.json's model_type, for a config that does not list its architectures.
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM",
                  "olmoe": "OlmoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM"}


def architecture_of(hf_config: dict) -> str:
  archs = hf_config.get("architectures") or []
  arch = archs[0] if archs else _BY_MODEL_TYPE.get(hf_config.get("model_type"))
  if arch not in ARCHITECTURES:
    raise UnsupportedModelError(f"architecture {arch or '(none in config.json)'} is not "
                                f"supported; supported: {', '.join(ARCHITECTURES)}")
  return arch


def _rope(hf: dict) -> tuple[float, dict]:
  """(theta, model.rope_* fields) from transformers 5's rope_parameters or 4's rope_theta +
  rope_scaling."""
  params = dict(hf.get("rope_parameters") or {})
  scaling = dict(hf.get("rope_scaling") or {})
  theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
  params = {**scaling, **params}
  kind = params.get("rope_type", params.get("type", "default"))
  if kind == "default":
    return theta, {}
  if kind == "linear":
    return theta, {"rope_scaling": "linear", "rope_factor": float(params["factor"])}
  if kind == "llama3":
    return theta, {"rope_scaling": "llama3", "rope_factor": float(params["factor"]),
                   "rope_low_freq_factor": float(params["low_freq_factor"]),
                   "rope_high_freq_factor": float(params["high_freq_factor"]),
                   "rope_original_max_len": int(params["original_max_position_embeddings"])}
  raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (none, linear, llama3)")


def _refuse(hf: dict, arch: str) -> None:
  """Settings of these architectures that the moejax model does not have."""
  if hf.get("hidden_act", "silu") != "silu":
    raise UnsupportedModelError(f"hidden_act={hf['hidden_act']!r}: only silu (SwiGLU)")
  if arch != "Qwen2MoeForCausalLM" and hf.get("attention_bias"):
    raise UnsupportedModelError("attention_bias=true (biases on q, k, v and o) is not supported")
  if hf.get("mlp_bias"):
    raise UnsupportedModelError("mlp_bias=true is not supported")
  if hf.get("use_sliding_window") or (arch == "MixtralForCausalLM" and hf.get("sliding_window")):
    raise UnsupportedModelError("sliding-window attention is not supported")
  if hf.get("partial_rotary_factor", 1.0) != 1.0:
    raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")


def config_from_hf(hf: dict, *, dtype: str, out_dir: str, eos_id: int,
                   tokenizer: str = "hf") -> Config:
  """The moejax Config of an HF config.json dict (16-bit experts; the importer sets
  inference.* for quantized ones)."""
  arch = architecture_of(hf)
  _refuse(hf, arch)
  try:
    D, H, L = int(hf["hidden_size"]), int(hf["num_attention_heads"]), int(hf["num_hidden_layers"])
    theta, rope = _rope(hf)
    model = {"vocab_size": int(hf["vocab_size"]), "d_model": D, "num_layers": L,
             "num_heads": H, "num_kv_heads": int(hf.get("num_key_value_heads") or H),
             "head_dim": int(hf.get("head_dim") or D // H),
             "ffn_hidden": int(hf["intermediate_size"]),
             "max_seq_len": int(hf.get("max_position_embeddings", 2048)),
             "rope_theta": theta, "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
             "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
             "dtype": dtype, "param_dtype": dtype, **rope}
    moe: dict = {"routing": "softmax_topk", "capacity_factor": 0.0}
    # Versions of transformers spell the expert count either way.
    experts = lambda: int(hf["num_local_experts" if "num_local_experts" in hf else "num_experts"])
    if arch == "LlamaForCausalLM":
      moe["first_dense_layers"] = L              # no MoE layer: every block a dense SwiGLU
    elif arch == "MixtralForCausalLM":
      moe.update(num_experts=experts(), top_k=int(hf["num_experts_per_tok"]),
                 expert_hidden=int(hf["intermediate_size"]), renormalize=True)
    else:
      moe.update(num_experts=experts(), top_k=int(hf["num_experts_per_tok"]),
                 renormalize=bool(hf.get("norm_topk_prob", False)))
    if arch == "OlmoeForCausalLM":
      moe["expert_hidden"] = int(hf["intermediate_size"])
      model.update(qk_norm="full", clip_qkv=float(hf.get("clip_qkv") or 0.0))
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
      # MoE where (i + 1) % step == 0, i.e. i = step-1, 2*step-1, ...; minus mlp_only_layers.
      step = int(hf.get("decoder_sparse_step", 1))
      moe.update(expert_hidden=int(hf["moe_intermediate_size"]), first_dense_layers=step - 1,
                 moe_every=step, dense_layers=[int(i) for i in hf.get("mlp_only_layers") or []])
    if arch == "Qwen2MoeForCausalLM":
      model["qkv_bias"] = bool(hf.get("qkv_bias", True))
      shared = int(hf.get("shared_expert_intermediate_size") or 0)
      if shared:
        moe.update(num_shared_experts=1, shared_expert_hidden=shared, shared_expert_gate=True)
    if arch == "Qwen3MoeForCausalLM":
      model["qk_norm"] = "head"
  except KeyError as err:
    raise UnsupportedModelError(f"config.json of {arch} lacks {err.args[0]!r}") from None
  seq_len = min(128, model["max_seq_len"])
  data = {"tokenizer": tokenizer, "eos_id": eos_id, "seq_len": seq_len}
  try:
    return from_dict({"model": model, "moe": moe, "data": data, "train": {"out_dir": out_dir}})
  except ConfigError as err:
    raise UnsupportedModelError(f"{arch}: the model does not fit moejax's config: {err}") from None


# ----------------------------------------------------------------- tensors ---

def _new(like: dict, path: Path_) -> np.ndarray:
  return np.empty(like[path].shape, like[path].dtype)


def _set(out: np.ndarray, value: np.ndarray) -> np.ndarray:
  out[...] = value          # casts (e.g. float32 -> bfloat16, round to nearest even)
  return out


def _plain(path: Path_, name: str, shape: tuple[int, ...], transpose: bool) -> Target:
  def build(fetch, like):
    x = fetch(name)
    return {path: _set(_new(like, path), x.T if transpose else x)}
  return Target({name: shape}, build)


def _expert_naming(keys: set[str], prefix: str) -> str:
  """Which naming one MoE layer's experts use: fused, w123 (Mixtral's per-expert w1 / w3 /
  w2) or proj (per-expert gate_proj / up_proj / down_proj)."""
  if f"{prefix}.experts.gate_up_proj" in keys:
    return "fused"
  return "w123" if f"{prefix}.experts.0.w1.weight" in keys else "proj"


def _experts(layer: Path_, prefix: str, naming: str, E: int, D: int, F: int) -> Target:
  """One layer's routed experts, stacked into preallocated [E, ...] arrays one HF tensor at
  a time (a layer's float experts are never held twice)."""
  gate, up, down = (layer + (n,) for n in ("w_gate_EDF", "w_up_EDF", "w_down_EFD"))
  if naming == "fused":
    names = (f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj")
    def build(fetch, like):
      w_gate, w_up, w_down = _new(like, gate), _new(like, up), _new(like, down)
      gate_up_E2FD = fetch(names[0])
      _set(w_gate, gate_up_E2FD[:, :F].transpose(0, 2, 1))
      _set(w_up, gate_up_E2FD[:, F:].transpose(0, 2, 1))
      del gate_up_E2FD
      _set(w_down, fetch(names[1]).transpose(0, 2, 1))
      return {gate: w_gate, up: w_up, down: w_down}
    return Target({names[0]: (E, 2 * F, D), names[1]: (E, D, F)}, build)
  kinds = ("w1", "w3", "w2") if naming == "w123" else ("gate_proj", "up_proj", "down_proj")
  per = {(j, kind): f"{prefix}.experts.{j}.{kind}.weight" for j in range(E) for kind in kinds}
  def build(fetch, like):
    out = {gate: _new(like, gate), up: _new(like, up), down: _new(like, down)}
    for j in range(E):
      for kind, path in zip(kinds, (gate, up, down)):
        _set(out[path][j], fetch(per[j, kind]).T)
    return out
  shapes = {name: ((D, F) if kind == kinds[2] else (F, D)) for (j, kind), name in per.items()}
  return Target(shapes, build)


def targets(cfg: Config, arch: str, keys: set[str]) -> list[Target]:
  """Every moejax parameter of `cfg`'s float model as Targets over HF tensor names;
  `keys` (the checkpoint's names) picks the expert naming per layer."""
  m, e = cfg.model, cfg.moe
  V, D, H, N, A = m.vocab_size, m.d_model, m.num_heads, m.num_kv_heads, m.head_dim
  out = [_plain(("embed_VD",), "model.embed_tokens.weight", (V, D), False),
         _plain(("final_norm", "scale"), "model.norm.weight", (D,), False)]
  if not m.tie_embeddings:
    out.append(_plain(("lm_head_DV",), "lm_head.weight", (V, D), True))
  for i in range(m.num_layers):
    b, hf = ("blocks", i), f"model.layers.{i}"
    a = b + ("attn",)
    out += [_plain(b + ("attn_norm", "scale"), f"{hf}.input_layernorm.weight", (D,), False),
            _plain(b + ("ffn_norm", "scale"), f"{hf}.post_attention_layernorm.weight", (D,), False),
            _plain(a + ("wq_DHd",), f"{hf}.self_attn.q_proj.weight", (H * A, D), True),
            _plain(a + ("wk_DKd",), f"{hf}.self_attn.k_proj.weight", (N * A, D), True),
            _plain(a + ("wv_DKd",), f"{hf}.self_attn.v_proj.weight", (N * A, D), True),
            _plain(a + ("wo_HdD",), f"{hf}.self_attn.o_proj.weight", (D, H * A), True)]
    if m.qkv_bias:
      out += [_plain(a + (f"{x}_bias_{s}",), f"{hf}.self_attn.{x}_proj.bias", (n * A,), False)
              for x, s, n in (("q", "HA", H), ("k", "NA", N), ("v", "NA", N))]
    if m.qk_norm != "none":
      q_dim, k_dim = (A, A) if m.qk_norm == "head" else (H * A, N * A)
      out += [_plain(a + ("q_norm", "scale"), f"{hf}.self_attn.q_norm.weight", (q_dim,), False),
              _plain(a + ("k_norm", "scale"), f"{hf}.self_attn.k_norm.weight", (k_dim,), False)]
    f = b + ("ffn",)
    if not is_moe_layer(cfg, i):
      Fd = m.ffn_hidden
      out += [_plain(f + ("w_gate_DF",), f"{hf}.mlp.gate_proj.weight", (Fd, D), True),
              _plain(f + ("w_up_DF",), f"{hf}.mlp.up_proj.weight", (Fd, D), True),
              _plain(f + ("w_down_FD",), f"{hf}.mlp.down_proj.weight", (D, Fd), True)]
      continue
    # Mixtral's checkpoints name the layer block_sparse_moe; transformers 5 in memory: mlp.
    prefix = f"{hf}.mlp"
    if arch == "MixtralForCausalLM" and any(k.startswith(f"{hf}.block_sparse_moe.") for k in keys):
      prefix = f"{hf}.block_sparse_moe"
    out.append(_plain(f + ("router_DE",), f"{prefix}.gate.weight", (e.num_experts, D), True))
    out.append(_experts(f, prefix, _expert_naming(keys, prefix), e.num_experts, D,
                        e.expert_hidden))
    if e.num_shared_experts:
      Fs = (e.shared_expert_hidden or e.expert_hidden) * e.num_shared_experts
      s = f + ("shared",)
      out += [_plain(s + ("w_gate_DF",), f"{prefix}.shared_expert.gate_proj.weight", (Fs, D), True),
              _plain(s + ("w_up_DF",), f"{prefix}.shared_expert.up_proj.weight", (Fs, D), True),
              _plain(s + ("w_down_FD",), f"{prefix}.shared_expert.down_proj.weight", (D, Fs), True)]
    if e.shared_expert_gate:
      name = f"{prefix}.shared_expert_gate.weight"
      def build_gate(fetch, like, path=f + ("shared_gate_D",), name=name):
        return {path: _set(_new(like, path), fetch(name)[0])}
      out.append(Target({name: (1, D)}, build_gate))
  return out


def check_names(cfg: Config, targets_: list[Target], keys: set[str]) -> None:
  """Every tensor the model needs is in the checkpoint, and the checkpoint holds nothing the
  model would silently drop (a tied head's copy of the embedding excepted)."""
  needed = {name for t in targets_ for name in t.sources}
  missing = sorted(needed - keys)
  if missing:
    raise UnsupportedModelError(f"the checkpoint lacks {len(missing)} tensor(s) the config "
                                f"implies, e.g. {', '.join(missing[:4])}")
  ignorable = {k for k in keys if k.endswith(IGNORED_SUFFIXES)}
  if cfg.model.tie_embeddings:
    ignorable.add("lm_head.weight")
  extra = sorted(keys - needed - ignorable)
  if extra:
    raise UnsupportedModelError(f"unsupported tensor(s), which the moejax model has no place "
                                f"for: {', '.join(extra[:6])}"
                                + (f" (+{len(extra) - 6} more)" if len(extra) > 6 else ""))
