"""Writes the Hugging Face fixtures of tests/convert/test_hf_import.py (not run by the tests).

Tiny randomly initialised float32 models of each architecture moejax imports, saved the
way transformers saves them, plus transformers' logits on fixed tokens. transformers and
torch are tools here, not moejax dependencies; run with a separate venv:

  python3 -m venv /tmp/hfvenv
  /tmp/hfvenv/bin/pip install torch==2.13.0     # first, explicitly: the CPU wheel
  /tmp/hfvenv/bin/pip install transformers safetensors numpy tokenizers
  /tmp/hfvenv/bin/python tests/convert/make_fixtures.py

-> tests/convert/fixtures/hf/<name>/: config.json, *.safetensors (+ index when sharded),
tokenizer.json, tokens.npy [B, T] int32, logits.npy [B, T, V] float32 (eager attention).
Written with transformers 5.25 / torch 2.13; save_pretrained writes experts one tensor
each (experts.N.w1 / gate_proj ...), so the *_fused fixtures save the in-memory fused
layout (experts.gate_up_proj, experts.down_proj) with safetensors directly.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers as tf
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = Path(__file__).parent / "fixtures" / "hf"
VOCAB = 320          # the tokenizer has 300 tokens: the model's vocabulary is padded past it
EOS = "<|endoftext|>"
TEXT = ("Whether 'tis nobler in the mind to suffer the slings and arrows of outrageous "
        "fortune, or to take arms against a sea of troubles and by opposing end them. ") * 8

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, initializer_range=0.2, eos_token_id=0, bos_token_id=None,
              pad_token_id=None)
MOE = dict(num_experts=4, num_experts_per_tok=2)

# name -> (config, how it is saved). Together: every architecture, both expert namings,
# a sharded checkpoint with its index, tied and untied heads, llama3 RoPE scaling.
FIXTURES = {
    "llama_tied_sharded": (tf.LlamaConfig(**COMMON, tie_word_embeddings=True), "sharded"),
    "llama_rope_scaled": (tf.LlamaConfig(**COMMON, tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}), "pretrained"),
    "mixtral": (tf.MixtralConfig(**{**COMMON, "intermediate_size": 32}, num_local_experts=4,
                                 num_experts_per_tok=2), "pretrained"),
    "mixtral_fused": (tf.MixtralConfig(**{**COMMON, "intermediate_size": 32},
                                       num_local_experts=4, num_experts_per_tok=2), "fused"),
    "olmoe": (tf.OlmoeConfig(**{**COMMON, "intermediate_size": 32}, **MOE, clip_qkv=1.5, norm_topk_prob=False), "pretrained"),
    "qwen2moe_fused": (tf.Qwen2MoeConfig(**COMMON, **MOE, moe_intermediate_size=24,
                                         shared_expert_intermediate_size=40, mlp_only_layers=[0],
                                         decoder_sparse_step=1, norm_topk_prob=False), "fused"),
    "qwen3moe": (tf.Qwen3MoeConfig(**COMMON, **MOE, moe_intermediate_size=24, head_dim=16,
                                   norm_topk_prob=True), "pretrained"),
}


def tokenizer_json() -> str:
  """A byte-level BPE of 300 tokens (id 0 is the end-of-text special): any text round-trips."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS], show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator([TEXT], trainer)
  return tok.to_str()


def randomize(model: torch.nn.Module, seed: int) -> None:
  """Norm scales and biases away from their 1 / 0 init, so a mapping mistake shows."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
      elif name.endswith("bias") or "shared_expert_gate" in name:
        p.copy_(0.2 * torch.randn(p.shape, generator=g))


def main() -> None:
  tok_json = tokenizer_json()
  tokens = Tokenizer.from_str(tok_json).encode(TEXT[:120]).ids
  tokens_BT = np.array([tokens[:16], tokens[16:32]], np.int64)
  if OUT.exists():
    shutil.rmtree(OUT)
  for seed, (name, (config, how)) in enumerate(FIXTURES.items()):
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                dtype=torch.float32).eval()
    randomize(model, seed)
    with torch.no_grad():
      logits = model(torch.from_numpy(tokens_BT)).logits.numpy()
    out = OUT / name
    if how == "fused":
      out.mkdir(parents=True)
      model.config.architectures = [type(model).__name__]
      model.config.save_pretrained(out)
      save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                out / "model.safetensors", metadata={"format": "pt"})
      reloaded = tf.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
      with torch.no_grad():    # transformers itself reads the fused layout back
        assert np.array_equal(reloaded(torch.from_numpy(tokens_BT)).logits.numpy(), logits)
    else:
      model.save_pretrained(out, max_shard_size="60KB" if how == "sharded" else "50GB")
    (out / "tokenizer.json").write_text(tok_json)
    np.save(out / "tokens.npy", tokens_BT.astype(np.int32))
    np.save(out / "logits.npy", logits.astype(np.float32))
    (out / "generation_config.json").unlink(missing_ok=True)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{name:20s} {type(model).__name__:22s} {size / 1024:6.0f} KB "
          f"{sorted(p.name for p in out.iterdir())}")
  info = {"transformers": tf.__version__, "torch": torch.__version__}
  (OUT / "versions.json").write_text(json.dumps(info, indent=2) + "\n")


if __name__ == "__main__":
  main()
