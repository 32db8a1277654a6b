"""moejax.convert.gguf on the tiny fixtures (make_gguf_fixture.py) and, if present, SmolLM2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

from moejax.convert.gguf import (permute_rotary_rows, read_gguf,  # noqa: E402
                                 unpermute_rotary_rows)
from moejax.convert.gguf_tokenizer import GGUFTokenizerError  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_gguf_fixture as fixture  # noqa: E402

DENSE_PATH = HERE / "fixtures" / "tiny_llama.gguf"
MOE_PATH = HERE / "fixtures" / "tiny_mixtral.gguf"
SMOLLM2_PATH = HERE.parents[1] / ".gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# Ids transformers' GGUF tokenizer (5.25) gives on the fixture vocabulary for this text.
TOKENIZER_TEXT = "To be, or not to be: 1599 é 東\n\n<|im_start|>user hi<|im_end|>"
TOKENIZER_IDS = [273, 279, 14, 271, 84, 306, 86, 264, 279, 28, 223, 19, 23, 27, 27, 223, 130,
                 105, 223, 165, 254, 112, 201, 201, 1, 87, 85, 71, 84, 223, 74, 75, 2]


@pytest.fixture(scope="module")
def dense():
  return read_gguf(DENSE_PATH)


@pytest.fixture(scope="module")
def moe():
  return read_gguf(MOE_PATH)


def _expected(spec: dict) -> dict[str, np.ndarray]:
  """The fixture's HF weights after the quantization round trip the file stored."""
  tokens, _ = fixture.train_vocab()
  weights = fixture.hf_weights(spec, len(tokens))
  quant = fixture.QUANT[spec["name"]]
  for name, w in weights.items():
    qtype = quant.get(name) or next((q for k, q in quant.items() if k.startswith("experts.")
                                     and name.endswith(k.split(".")[1] + ".weight")), None)
    if qtype is not None:
      t = gguf.GGMLQuantizationType[qtype]
      weights[name] = gguf.quants.dequantize(gguf.quants.quantize(w, t), t)
  return weights


def test_names_and_shapes_map_to_hf(dense):
  hf = fixture.hf_weights(fixture.DENSE, dense.hf_config["vocab_size"])
  assert sorted(dense.keys()) == sorted(hf)
  assert "model.layers.1.self_attn.q_proj.weight" in dense
  for name in dense.keys():
    w = dense.get(name)
    assert w.dtype == np.float32 and w.shape == hf[name].shape, name
  assert dense.ggml_type("model.layers.1.self_attn.q_proj.weight") == "Q4_1"


def test_values_equal_hf_weights_with_qk_unpermuted(dense):
  # q/k rows were permuted to llama.cpp's interleaved order before writing; F32 tensors must
  # come back bit for bit, quantized ones as the quantize -> dequantize round trip of HF's.
  expected = _expected(fixture.DENSE)
  for name in dense.keys():
    np.testing.assert_array_equal(dense.get(name), expected[name], err_msg=name)
  hf = fixture.hf_weights(fixture.DENSE, dense.hf_config["vocab_size"])
  q = "model.layers.1.self_attn.q_proj.weight"  # Q4_1: within its quantization error.
  np.testing.assert_allclose(dense.get(q), hf[q], atol=0.5 * np.abs(hf[q]).max() / 7)


def test_dequantized_values_match_gguf_dequantize(dense):
  reader = gguf.GGUFReader(DENSE_PATH)
  raw = {t.name: t for t in reader.tensors}
  for gguf_name, hf_name, heads in (("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", None),
                                    ("token_embd.weight", "model.embed_tokens.weight", None),
                                    ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", 2),
                                    ("blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj.weight", 4)):
    t = raw[gguf_name]
    assert t.tensor_type.name in ("Q8_0", "Q4_1")
    ref = gguf.quants.dequantize(t.data, t.tensor_type)
    if heads:
      ref = unpermute_rotary_rows(ref, heads)
    np.testing.assert_array_equal(dense.get(hf_name), ref, err_msg=gguf_name)


@pytest.mark.parametrize("heads,head_dim,cols", [(1, 4, 3), (4, 8, 5), (3, 64, 1)])
def test_unpermute_inverts_llama_cpp_permute(heads, head_dim, cols):
  w = np.random.default_rng(0).standard_normal((heads * head_dim, cols)).astype(np.float32)
  p = permute_rotary_rows(w, heads)
  assert not np.array_equal(p, w)
  np.testing.assert_array_equal(unpermute_rotary_rows(p, heads), w)
  # Row (h, 2i) of llama.cpp's order is HF's row (h, i): the first half of head h.
  np.testing.assert_array_equal(p[0::2][:head_dim // 2], w[:head_dim // 2])


def test_hf_config(dense, moe):
  c = dense.hf_config
  assert c["architectures"] == ["LlamaForCausalLM"]
  assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (32, 64, 2)
  assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (4, 2, 8)
  assert (c["rms_norm_eps"], c["rope_theta"], c["vocab_size"]) == (1e-5, 10000.0, 320)
  assert (c["max_position_embeddings"], c["tie_word_embeddings"]) == (256, False)
  assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)
  assert "num_local_experts" not in c
  json.dumps(c)  # A config.json.
  m = moe.hf_config
  assert m["architectures"] == ["MixtralForCausalLM"] and m["tie_word_embeddings"] is True
  assert (m["num_local_experts"], m["num_experts_per_tok"], m["intermediate_size"]) == (4, 2, 32)


def test_moe_stacked_experts_map_per_expert(moe):
  expected = _expected(fixture.MOE)
  assert sorted(moe.keys()) == sorted(expected)
  assert "lm_head.weight" not in moe  # Tied.
  for name in moe.keys():
    np.testing.assert_array_equal(moe.get(name), expected[name], err_msg=name)
  assert moe.get("model.layers.0.block_sparse_moe.experts.3.w2.weight").shape == (32, 32)
  assert moe.get("model.layers.0.block_sparse_moe.gate.weight").shape == (4, 32)


def test_tokenizer_ids_and_round_trip(dense):
  tok = tokenizers.Tokenizer.from_str(dense.tokenizer_json)
  enc = tok.encode(TOKENIZER_TEXT)
  assert enc.ids == TOKENIZER_IDS
  assert enc.tokens[11:15] == ["1", "5", "9", "9"]  # smollm pre-tokenizer: one digit each.
  assert tok.decode(enc.ids, skip_special_tokens=False) == TOKENIZER_TEXT
  for text in (fixture.TRAIN_TEXT, "  leading spaces\ttabs\r\nand ünïcödé 🤖 ", ""):
    assert tok.decode(tok.encode(text).ids) == text
  assert tok.token_to_id("<|im_end|>") == 2 and tok.get_vocab_size() == 320
  added = {t["content"]: t["special"] for t in json.loads(dense.tokenizer_json)["added_tokens"]}
  assert added == {t: True for t in fixture.SPECIAL_TOKENS}


def test_sentencepiece_vocab_encodes_like_sentencepiece(tmp_path):
  # A "llama" (SentencePiece BPE) GGUF vocabulary, as llama.cpp writes one from a .model.
  import io
  import sentencepiece as spm
  proto = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter((fixture.TRAIN_TEXT * 3).split("\n")), model_writer=proto,
      model_type="bpe", vocab_size=400, hard_vocab_limit=False, byte_fallback=True,
      character_coverage=1.0, normalization_rule_name="identity",
      remove_extra_whitespaces=False, minloglevel=2)
  sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
  n = sp.get_piece_size()
  T = gguf.TokenType
  types = [T.UNKNOWN if sp.is_unknown(i) else T.CONTROL if sp.is_control(i) else
           T.BYTE if sp.is_byte(i) else T.NORMAL for i in range(n)]
  w = gguf.GGUFWriter(tmp_path / "spm.gguf", "llama")
  w.add_block_count(1)
  w.add_embedding_length(8)
  w.add_feed_forward_length(16)
  w.add_head_count(2)
  w.add_tokenizer_model("llama")
  w.add_token_list([sp.id_to_piece(i) for i in range(n)])
  w.add_token_scores([sp.get_score(i) for i in range(n)])
  w.add_token_types(types)
  w.add_bos_token_id(sp.bos_id())
  w.add_eos_token_id(sp.eos_id())
  w.add_unk_token_id(sp.unk_id())
  w.add_tensor("token_embd.weight", np.zeros((n, 8), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  tok = tokenizers.Tokenizer.from_str(read_gguf(tmp_path / "spm.gguf").tokenizer_json)
  for text in (fixture.TRAIN_TEXT, "Whether 'tis  nobler\nin the mind 東京 1599", "  two"):
    ids = tok.encode(text).ids
    assert ids == [sp.bos_id()] + sp.encode(text), text  # llama.cpp adds BOS by default.
    assert tok.decode(ids) == text


# -- errors -------------------------------------------------------------------------------

def _write_gguf(path: Path, arch: str = "llama", extra_tensor: str | None = None,
                tokenizer_model: str | None = None) -> Path:
  w = gguf.GGUFWriter(path, arch)
  w.add_block_count(1)
  w.add_embedding_length(8)
  w.add_feed_forward_length(16)
  w.add_head_count(2)
  if tokenizer_model:
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list(["a", "b"])
  w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  if extra_tensor:
    w.add_tensor(extra_tensor, np.zeros(8, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def test_errors_name_what_is_unsupported(tmp_path, dense):
  with pytest.raises(FileNotFoundError, match="nothere.gguf"):
    read_gguf(tmp_path / "nothere.gguf")
  with pytest.raises(ValueError, match="architecture 'gpt_neox' is not supported"):
    read_gguf(_write_gguf(tmp_path / "neox.gguf", arch="gpt_neox"))
  with pytest.raises(ValueError, match=r"unknown tensor name\(s\).*blk\.0\.attn_q_norm\.weight"):
    read_gguf(_write_gguf(tmp_path / "qnorm.gguf", extra_tensor="blk.0.attn_q_norm.weight"))
  with pytest.raises(GGUFTokenizerError, match="'bert' is not supported yet"):
    read_gguf(_write_gguf(tmp_path / "bert_vocab.gguf", tokenizer_model="bert"))
  with pytest.raises(KeyError, match="model.layers.9.mlp.up_proj.weight"):
    dense.get("model.layers.9.mlp.up_proj.weight")
  assert read_gguf(_write_gguf(tmp_path / "novocab.gguf")).tokenizer_json is None


# -- the real SmolLM2 GGUF (.gguf/, see make_gguf_reference.py) ----------------------------

@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2_PATH.is_file(), reason=f"{SMOLLM2_PATH} not present")
def test_smollm2_gguf():
  ckpt = read_gguf(SMOLLM2_PATH)
  c = ckpt.hf_config
  assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
          c["num_key_value_heads"], c["head_dim"], c["vocab_size"]) == (576, 30, 9, 3, 64, 49152)
  assert c["tie_word_embeddings"] and c["rope_theta"] == 100000.0
  assert len(ckpt.keys()) == 272 and "lm_head.weight" not in ckpt
  assert ckpt.get("model.embed_tokens.weight").shape == (49152, 576)
  q = ckpt.get("model.layers.29.self_attn.q_proj.weight")
  assert q.shape == (576, 576) and np.isfinite(q).all()
  tok = tokenizers.Tokenizer.from_str(ckpt.tokenizer_json)
  enc = tok.encode("<|im_start|>user\nHello world 42<|im_end|>")
  assert enc.tokens == ["<|im_start|>", "user", "Ċ", "Hello", "Ġworld", "Ġ", "4", "2",
                        "<|im_end|>"]
  ref_ids = SMOLLM2_PATH.parent / "smollm2_ref_ids.npy"
  if ref_ids.is_file():  # Written by make_gguf_reference.py from transformers' tokenizer.
    text = (SMOLLM2_PATH.parent / "smollm2_ref_text.txt").read_text(encoding="utf-8")
    np.testing.assert_array_equal(tok.encode(text).ids, np.load(ref_ids))
