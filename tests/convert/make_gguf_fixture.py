"""Writes the tiny GGUF fixtures of tests/convert/test_gguf.py (run with moejax's venv):

    .venv/bin/python tests/convert/make_gguf_fixture.py   # -> tests/convert/fixtures/*.gguf

- tiny_llama.gguf: a 2-layer dense Llama (d 32, 4 heads, 2 kv-heads, FFN 64, untied head);
- tiny_mixtral.gguf: a 1-layer Llama with 4 experts (top-2), stacked ffn_*_exps tensors.

Weights are drawn in HF layout by `hf_weights` (seeded, so the test recomputes them), then
written the way llama.cpp's convert_hf_to_gguf.py does: q_proj / k_proj rows permuted to
the interleaved rotary order, Mixtral experts stacked, some tensors quantized (QUANT).
Both share a byte-level BPE vocabulary (3 control tokens, 256 bytes, merges trained on
TRAIN_TEXT with `tokenizers`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from moejax.convert.gguf import permute_rotary_rows  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 320
TRAIN_TEXT = """To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles,
And by opposing end them? To die: to sleep;
No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks
That flesh is heir to, 'tis a consummation
Devoutly to be wish'd. To die, to sleep.
"""
DENSE = dict(name="tiny_llama", layers=2, d=32, heads=4, kv_heads=2, ffn=64, experts=0,
             top_k=0, tied=False, seed=0)
MOE = dict(name="tiny_mixtral", layers=1, d=32, heads=4, kv_heads=2, ffn=32, experts=4,
           top_k=2, tied=True, seed=1)
# HF name -> ggml type name for the tensors not stored as F32 (the rest are F32).
QUANT = {
    "tiny_llama": {"model.embed_tokens.weight": "Q8_0",
                   "model.layers.0.self_attn.k_proj.weight": "Q8_0",
                   "model.layers.1.self_attn.q_proj.weight": "Q4_1",
                   "model.layers.0.mlp.down_proj.weight": "Q4_1",
                   "lm_head.weight": "Q8_0"},
    "tiny_mixtral": {"experts.w1": "Q8_0", "experts.w2": "Q4_1"},  # Whole stacked tensors.
}


def train_vocab() -> tuple[list[str], list[str]]:
  """(tokens, merges) of a byte-level BPE: control tokens first, then bytes, then merges."""
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator([TRAIN_TEXT], trainer)
  import json
  model = json.loads(tok.to_str())["model"]
  tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  return tokens, merges


def hf_weights(spec: dict, vocab_size: int) -> dict[str, np.ndarray]:
  """HF-layout float32 weights ([out, in] for Linear) of the fixture `spec`."""
  rng = np.random.default_rng(spec["seed"])
  d, f, a = spec["d"], spec["ffn"], spec["d"] // spec["heads"]
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32) * 0.5
  w = {"model.embed_tokens.weight": normal(vocab_size, d)}
  for i in range(spec["layers"]):
    p = f"model.layers.{i}."
    w[p + "input_layernorm.weight"] = 1 + normal(d)
    w[p + "self_attn.q_proj.weight"] = normal(spec["heads"] * a, d)
    w[p + "self_attn.k_proj.weight"] = normal(spec["kv_heads"] * a, d)
    w[p + "self_attn.v_proj.weight"] = normal(spec["kv_heads"] * a, d)
    w[p + "self_attn.o_proj.weight"] = normal(d, spec["heads"] * a)
    w[p + "post_attention_layernorm.weight"] = 1 + normal(d)
    if spec["experts"]:
      w[p + "block_sparse_moe.gate.weight"] = normal(spec["experts"], d)
      for e in range(spec["experts"]):
        q = f"{p}block_sparse_moe.experts.{e}."
        w[q + "w1.weight"], w[q + "w3.weight"] = normal(f, d), normal(f, d)
        w[q + "w2.weight"] = normal(d, f)
    else:
      w[p + "mlp.gate_proj.weight"] = normal(f, d)
      w[p + "mlp.up_proj.weight"] = normal(f, d)
      w[p + "mlp.down_proj.weight"] = normal(d, f)
  w["model.norm.weight"] = 1 + normal(d)
  if not spec["tied"]:
    w["lm_head.weight"] = normal(vocab_size, d)
  return w


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "block_sparse_moe.gate": "ffn_gate_inp",
}


def write_fixture(spec: dict, path: Path) -> None:
  import gguf
  tokens, merges = train_vocab()
  w = hf_weights(spec, len(tokens))
  quant = QUANT[spec["name"]]
  writer = gguf.GGUFWriter(path, "llama")
  writer.add_name(spec["name"])
  writer.add_block_count(spec["layers"])
  writer.add_context_length(256)
  writer.add_embedding_length(spec["d"])
  writer.add_feed_forward_length(spec["ffn"])
  writer.add_head_count(spec["heads"])
  writer.add_head_count_kv(spec["kv_heads"])
  writer.add_rope_freq_base(10000.0)
  writer.add_layer_norm_rms_eps(1e-5)
  writer.add_rope_dimension_count(spec["d"] // spec["heads"])
  writer.add_vocab_size(len(tokens))
  if spec["experts"]:
    writer.add_expert_count(spec["experts"])
    writer.add_expert_used_count(spec["top_k"])
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("smollm")
  writer.add_token_list(tokens)
  writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL_TOKENS
                          else gguf.TokenType.NORMAL for t in tokens])
  writer.add_token_merges(merges)
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.add_add_bos_token(False)

  def add(name: str, array: np.ndarray, qtype: str | None) -> None:
    if qtype is None:
      writer.add_tensor(name, array.astype(np.float32))
    else:
      t = gguf.GGMLQuantizationType[qtype]
      writer.add_tensor(name, gguf.quants.quantize(array, t), raw_dtype=t)

  add("token_embd.weight", w["model.embed_tokens.weight"], quant.get("model.embed_tokens.weight"))
  for i in range(spec["layers"]):
    p = f"model.layers.{i}."
    for hf, short in _GGUF_NAMES.items():
      if p + hf + ".weight" not in w:
        continue
      array = w[p + hf + ".weight"]
      if hf == "self_attn.q_proj":
        array = permute_rotary_rows(array, spec["heads"])
      elif hf == "self_attn.k_proj":
        array = permute_rotary_rows(array, spec["kv_heads"])
      add(f"blk.{i}.{short}.weight", array, quant.get(p + hf + ".weight"))
    if spec["experts"]:
      for proj, short in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
        stacked = np.stack([w[f"{p}block_sparse_moe.experts.{e}.{proj}.weight"]
                            for e in range(spec["experts"])])      # [E, out, in]
        add(f"blk.{i}.ffn_{short}_exps.weight", stacked, quant.get(f"experts.{proj}"))
  add("output_norm.weight", w["model.norm.weight"], None)
  if not spec["tied"]:
    add("output.weight", w["lm_head.weight"], quant.get("lm_head.weight"))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


if __name__ == "__main__":
  FIXTURES.mkdir(exist_ok=True)
  for spec in (DENSE, MOE):
    out = FIXTURES / f"{spec['name']}.gguf"
    write_fixture(spec, out)
    print(f"{out}: {out.stat().st_size} bytes")
