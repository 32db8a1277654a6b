"""Reads a llama.cpp GGUF file as Hugging Face-named float32 tensors.

    ckpt = read_gguf("model.gguf")
    ckpt.hf_config            # a transformers-style config.json dict
    ckpt.keys()               # ["model.embed_tokens.weight", ...]
    ckpt.get(name)            # float32 np.ndarray in HF layout, dequantized
    ckpt.tokenizer_json       # a `tokenizers` tokenizer.json string, or None

The file is memory-mapped (gguf.GGUFReader); `get` dequantizes one tensor at a time, so
a model larger than memory can be converted tensor by tensor.

Two things llama.cpp's convert_hf_to_gguf.py changes that are undone here:
- dimension order: ggml lists ne[] fastest-first, so a numpy view has the reversed shape;
  for a Linear weight ne = [in, out] and the numpy view is HF's [out, in] already;
- Llama q_proj / k_proj rows are permuted per head from HF's half-split rotary layout
  (moejax/model/layers.py `rope`) to the interleaved one llama.cpp rotates; we permute back.

Supported: architecture "llama" (dense, e.g. SmolLM2; with experts = Mixtral, stacked
`ffn_*_exps` or older per-expert `ffn_*.E` tensors).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama",)

# llama.cpp per-layer tensor -> HF name under model.layers.{i}. (dense Llama naming).
_DENSE_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_DENSE_FFN = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")  # Not in a MoE layer.
# Mixtral: the router and the experts' w1 (gate), w3 (up), w2 (down).
_MOE_ROUTER = ("ffn_gate_inp.weight", "block_sparse_moe.gate.weight")
_EXPERT_PROJ = {"gate": "w1", "up": "w3", "down": "w2"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_STACKED_EXPERTS_RE = re.compile(r"^ffn_(gate|up|down)_exps\.weight$")
_SPLIT_EXPERT_RE = re.compile(r"^ffn_(gate|up|down)\.(\d+)\.weight$")


def read_gguf(path: str | os.PathLike) -> "GGUFCheckpoint":
  """Opens (memory-maps) a GGUF file; raises for a missing file or unsupported content."""
  return GGUFCheckpoint(path)


def unpermute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's `permute` of q_proj / k_proj rows (interleaved -> half-split).

  w: [n_heads * A, ...]. llama.cpp wrote row (h, i, j) of shape [n_heads, A/2, 2] from
  HF row (h, j, i) of shape [n_heads, 2, A/2]; swapping back restores HF's order.
  """
  half = w.shape[0] // n_heads // 2
  return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp's convert_hf_to_gguf `permute` (half-split -> interleaved); for fixtures."""
  half = w.shape[0] // n_heads // 2
  return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Source:
  """Where one HF tensor comes from: a GGUF tensor, optionally one expert of it."""
  __slots__ = ("tensor", "expert", "rotary_heads")

  def __init__(self, tensor, expert: int | None = None, rotary_heads: int | None = None):
    self.tensor, self.expert, self.rotary_heads = tensor, expert, rotary_heads


class GGUFCheckpoint:
  """A GGUF file seen as a Hugging Face checkpoint (see the module docstring)."""

  def __init__(self, path: str | os.PathLike):
    import gguf  # Imported here: only conversion needs it.
    self._gguf = gguf
    self.path = Path(path)
    if not self.path.is_file():
      raise FileNotFoundError(f"GGUF file not found: {self.path}")
    self._reader = gguf.GGUFReader(self.path, "r")
    self.metadata_keys = tuple(self._reader.fields)
    self.architecture = self._field("general.architecture")
    if self.architecture not in SUPPORTED_ARCHITECTURES:
      raise ValueError(
          f"{self.path.name}: GGUF architecture {self.architecture!r} is not supported; "
          f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    self.hf_config = self._build_hf_config()
    self._sources = self._map_tensors()
    from moejax.convert.gguf_tokenizer import tokenizer_json_from_gguf
    self.tokenizer_json: str | None = tokenizer_json_from_gguf(self._field, self.path.name)

  # -- metadata -------------------------------------------------------------------------

  def _field(self, key: str, default=None):
    """A metadata value (str, number, bool or list), or `default` when absent."""
    field = self._reader.fields.get(key)
    return default if field is None else field.contents()

  def _arch_field(self, key: str, default=None, required: bool = False):
    value = self._field(f"{self.architecture}.{key}", default)
    if value is None and required:
      raise ValueError(f"{self.path.name}: metadata {self.architecture}.{key} is missing")
    return value

  def _build_hf_config(self) -> dict:
    tensors = {t.name: t for t in self._reader.tensors}
    d_model = int(self._arch_field("embedding_length", required=True))
    n_heads = int(self._arch_field("attention.head_count", required=True))
    n_kv = int(self._arch_field("attention.head_count_kv", n_heads))
    head_dim = int(self._arch_field("attention.key_length", d_model // n_heads))
    rope_dim = int(self._arch_field("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
      raise ValueError(f"{self.path.name}: partial rotary embedding (rope.dimension_count "
                       f"{rope_dim} != head_dim {head_dim}) is not supported")
    if self._arch_field("rope.scaling.type") not in (None, "none") or "rope_freqs.weight" in tensors:
      raise ValueError(f"{self.path.name}: RoPE scaling (rope.scaling.* or rope_freqs.weight, "
                       "e.g. Llama 3.1) is not supported yet")
    tokens = self._reader.fields.get("tokenizer.ggml.tokens")
    vocab = self._arch_field("vocab_size")
    if vocab is None:
      vocab = len(tokens.data) if tokens is not None else int(tensors["token_embd.weight"].shape[1])
    n_experts = int(self._arch_field("expert_count", 0) or 0)
    config = {
        "architectures": ["MixtralForCausalLM" if n_experts else "LlamaForCausalLM"],
        "model_type": "mixtral" if n_experts else "llama",
        "hidden_size": d_model,
        "intermediate_size": int(self._arch_field("feed_forward_length", required=True)),
        "num_hidden_layers": int(self._arch_field("block_count", required=True)),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(self._arch_field("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(self._arch_field("rope.freq_base", 10000.0)),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(self._arch_field("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": False,
        "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": self._field("tokenizer.ggml.eos_token_id"),
        "pad_token_id": self._field("tokenizer.ggml.padding_token_id"),
    }
    if n_experts:
      config["num_local_experts"] = n_experts
      config["num_experts_per_tok"] = int(self._arch_field("expert_used_count", required=True))
    # rms_norm_eps is stored as float32 (1e-5 reads 9.99999974e-06): round to float32's
    # 7 significant digits so the config says what the HF one did.
    config["rms_norm_eps"] = float(f"{config['rms_norm_eps']:.7g}")
    return config

  # -- tensor names -----------------------------------------------------------------------

  def _map_tensors(self) -> dict[str, _Source]:
    cfg = self.hf_config
    n_layers, n_experts = cfg["num_hidden_layers"], cfg.get("num_local_experts", 0)
    rotary_heads = {"attn_q.weight": cfg["num_attention_heads"],
                    "attn_k.weight": cfg["num_key_value_heads"]}
    sources: dict[str, _Source] = {}
    unknown: list[str] = []
    for t in self._reader.tensors:
      if t.name in _GLOBAL_NAMES:
        sources[_GLOBAL_NAMES[t.name]] = _Source(t)
        continue
      m = _LAYER_RE.match(t.name)
      if m is None or int(m.group(1)) >= n_layers:
        unknown.append(t.name)
        continue
      prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
      if n_experts and rest == _MOE_ROUTER[0]:
        sources[prefix + _MOE_ROUTER[1]] = _Source(t)
      elif n_experts and (e := _STACKED_EXPERTS_RE.match(rest)):
        w = _EXPERT_PROJ[e.group(1)]
        if len(t.shape) != 3 or int(t.shape[2]) != n_experts:
          raise ValueError(f"{self.path.name}: {t.name} has ggml shape {t.shape.tolist()}, "
                           f"expected [in, out, {n_experts}]")
        for expert in range(n_experts):
          sources[f"{prefix}block_sparse_moe.experts.{expert}.{w}.weight"] = _Source(t, expert)
      elif n_experts and (e := _SPLIT_EXPERT_RE.match(rest)):
        w = _EXPERT_PROJ[e.group(1)]
        sources[f"{prefix}block_sparse_moe.experts.{e.group(2)}.{w}.weight"] = _Source(t)
      elif rest in _DENSE_LAYER_NAMES and not (n_experts and rest in _DENSE_FFN):
        sources[prefix + _DENSE_LAYER_NAMES[rest]] = _Source(t, rotary_heads=rotary_heads.get(rest))
      else:
        unknown.append(t.name)
    if unknown:
      shown = ", ".join(unknown[:8]) + (f" (+{len(unknown) - 8} more)" if len(unknown) > 8 else "")
      raise ValueError(f"{self.path.name}: unknown tensor name(s) for a "
                       f"{cfg['architectures'][0]} GGUF: {shown}")
    if "model.embed_tokens.weight" not in sources:
      raise ValueError(f"{self.path.name}: no token_embd.weight tensor")
    return sources

  # -- tensors ----------------------------------------------------------------------------

  def keys(self) -> list[str]:
    """HF tensor names, in file order (experts in order within their tensor)."""
    return list(self._sources)

  def __contains__(self, name: str) -> bool:
    return name in self._sources

  def ggml_type(self, name: str) -> str:
    """The stored quantization of an HF tensor, e.g. "Q4_1", "F32"."""
    return self._source(name).tensor.tensor_type.name

  def _source(self, name: str) -> _Source:
    try:
      return self._sources[name]
    except KeyError:
      raise KeyError(f"{name!r} is not a tensor of {self.path.name}; see keys()") from None

  def get(self, name: str) -> np.ndarray:
    """One tensor as float32 in HF layout ([out, in] for Linear), dequantized."""
    src = self._source(name)
    t = src.tensor
    data = t.data if src.expert is None else t.data[src.expert]  # Dequantize one expert only.
    ne = [int(n) for n in t.shape]
    shape = tuple(reversed(ne if src.expert is None else ne[:-1]))
    w = self._gguf.quants.dequantize(data, t.tensor_type).reshape(shape)
    if src.rotary_heads is not None:
      w = unpermute_rotary_rows(w, src.rotary_heads)
    # A copy: an F32 tensor dequantizes to a read-only view of the memory map.
    return np.array(w, np.float32, order="C", copy=True)

  def __repr__(self) -> str:
    c = self.hf_config
    return (f"GGUFCheckpoint({self.path.name!r}, {c['architectures'][0]}, "
            f"layers={c['num_hidden_layers']}, d={c['hidden_size']}, tensors={len(self._sources)})")
