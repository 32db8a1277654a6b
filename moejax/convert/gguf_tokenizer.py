"""Builds a `tokenizers` tokenizer.json from the vocabulary a GGUF file embeds.

A GGUF has no tokenizer.json; llama.cpp stores `tokenizer.ggml.model` (the algorithm),
`.pre` (its pre-tokenizer, by name), `.tokens`, `.token_type`, `.merges`, `.scores` and the
special token ids. We rebuild what llama.cpp runs (llama-vocab.cpp):

- "gpt2": byte-level BPE with the file's merges; text is split by the regexes llama.cpp
  uses for the `pre` name, then mapped to the byte alphabet;
- "llama": SentencePiece BPE, as the Llama-2 tokenizer.json spells it: spaces become "▁",
  one "▁" is prepended (tokenizer.ggml.add_space_prefix, default true), merges are ranked
  by the merged piece's score, unknown characters fall back to <0xXX> byte tokens.

Tokens the file marks CONTROL become special added tokens, USER_DEFINED ones plain added
tokens (matched whole in the text, as llama.cpp does). BOS / EOS are added by a
post-processor only when tokenizer.ggml.add_bos_token / add_eos_token say so.
"""

from __future__ import annotations

import json
from typing import Callable

# llama.cpp token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regexes llama.cpp applies in order (llama-vocab.cpp).
_BYTE_LEVEL_SPLITS = {
    "default": [_GPT2_SPLIT], "gpt2": [_GPT2_SPLIT], "gpt-2": [_GPT2_SPLIT],
    # One regex per digit first, then GPT-2's (SmolLM's tokenizer.json: Digits + ByteLevel).
    **{name: [r"\p{N}", _GPT2_SPLIT] for name in
       ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")},
    **{name: [_LLAMA3_SPLIT] for name in
       ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe")},
    **{name: [_QWEN2_SPLIT] for name in ("qwen2", "deepseek-r1-qwen", "megrez")},
}


class GGUFTokenizerError(ValueError):
  """The GGUF's tokenizer cannot be rebuilt (an unsupported model or pre-tokenizer)."""


def tokenizer_json_from_gguf(field: Callable, source: str = "GGUF") -> str | None:
  """tokenizer.json (a string) for the GGUF whose metadata `field(key, default)` reads.

  None when the file embeds no vocabulary; GGUFTokenizerError for kinds not supported.
  """
  kind = field("tokenizer.ggml.model")
  if kind is None or field("tokenizer.ggml.tokens") is None:
    return None
  if kind == "gpt2":
    tok = _byte_level_bpe(field, source)
  elif kind == "llama":
    tok = _sentencepiece_bpe(field, source)
  else:
    raise GGUFTokenizerError(
        f"{source}: tokenizer.ggml.model {kind!r} is not supported yet (supported: 'gpt2' "
        "byte-level BPE, 'llama' SentencePiece)")
  _add_special_tokens(tok, field)
  # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
  _set_post_processor(tok, field, bos_by_default=(kind == "llama"))
  return tok.to_str()


def _token_types(field, n: int) -> list[int]:
  return list(field("tokenizer.ggml.token_type") or [_NORMAL] * n)


def _split_merges(merges: list[str]) -> list[tuple[str, str]]:
  # Byte-level and "▁" spellings hold no literal space, so the one space separates the pair.
  return [tuple(m.split(" ", 1)) for m in merges]


def _byte_level_bpe(field, source: str):
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
  pre = field("tokenizer.ggml.pre", "default")
  splits = _BYTE_LEVEL_SPLITS.get(pre)
  if splits is None:
    raise GGUFTokenizerError(
        f"{source}: byte-level pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported yet; "
        f"supported: {', '.join(sorted(_BYTE_LEVEL_SPLITS))}")
  tokens = field("tokenizer.ggml.tokens")
  merges = field("tokenizer.ggml.merges")
  if not merges:
    raise GGUFTokenizerError(f"{source}: a 'gpt2' tokenizer without tokenizer.ggml.merges")
  vocab = {t: i for i, t in enumerate(tokens)}
  tok = Tokenizer(models.BPE(vocab, _split_merges(merges), fuse_unk=False, byte_fallback=False))
  tok.pre_tokenizer = pre_tokenizers.Sequence(
      [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
      + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  return tok


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
  """Merges a SentencePiece BPE implies: every split of a piece into two pieces, ranked by
  the merged piece's score (llama.cpp's SPM tokenizer merges the best-scoring pair first)."""
  vocab = {t: i for i, t in enumerate(tokens)}
  ranked = []
  for piece, score in zip(tokens, scores):
    for k in range(1, len(piece)):
      left, right = piece[:k], piece[k:]
      if left in vocab and right in vocab:
        ranked.append((-score, vocab[left], vocab[right], left, right))
  ranked.sort()
  return [(left, right) for *_, left, right in ranked]


def _sentencepiece_bpe(field, source: str):
  from tokenizers import Tokenizer, decoders, models, normalizers
  tokens = field("tokenizer.ggml.tokens")
  types = _token_types(field, len(tokens))
  scores = field("tokenizer.ggml.scores")
  if scores is None:
    raise GGUFTokenizerError(f"{source}: a 'llama' tokenizer without tokenizer.ggml.scores")
  # Only normal pieces merge; control, byte and user-defined tokens are never built by BPE.
  mergeable = [(t, s) for t, s, ty in zip(tokens, scores, types) if ty == _NORMAL]
  merges = _sentencepiece_merges([t for t, _ in mergeable], [s for _, s in mergeable])
  unk_id = field("tokenizer.ggml.unknown_token_id")
  unk = tokens[unk_id] if unk_id is not None else None
  vocab = {t: i for i, t in enumerate(tokens)}
  tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
  steps = [normalizers.Replace(" ", "\u2581")]
  if field("tokenizer.ggml.add_space_prefix", True):
    steps.insert(0, normalizers.Prepend("\u2581"))
  tok.normalizer = normalizers.Sequence(steps)
  strip = [decoders.Strip(" ", 1, 0)] if field("tokenizer.ggml.add_space_prefix", True) else []
  tok.decoder = decoders.Sequence(
      [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()] + strip)
  return tok


def _add_special_tokens(tok, field) -> None:
  from tokenizers import AddedToken
  tokens = field("tokenizer.ggml.tokens")
  types = _token_types(field, len(tokens))
  special = [AddedToken(t, special=True, normalized=False)
             for t, ty in zip(tokens, types) if ty == _CONTROL and t]
  user = [AddedToken(t, special=False, normalized=False)
          for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t]
  if special:
    tok.add_special_tokens(special)
  if user:
    tok.add_tokens(user)


def _set_post_processor(tok, field, bos_by_default: bool) -> None:
  from tokenizers import processors
  tokens = field("tokenizer.ggml.tokens")
  ends = []
  for flag, key, default in (("add_bos_token", "bos_token_id", bos_by_default),
                             ("add_eos_token", "eos_token_id", False)):
    tid = field(f"tokenizer.ggml.{key}")
    if field(f"tokenizer.ggml.{flag}", default) and tid is not None:
      ends.append((tokens[tid], tid))
    else:
      ends.append(None)
  bos, eos = ends
  if bos is None and eos is None:
    return
  head = [bos[0]] if bos else []
  tail = [eos[0]] if eos else []
  tok.post_processor = processors.TemplateProcessing(
      single=" ".join(head + ["$A"] + tail),
      pair=" ".join(head + ["$A"] + tail + head + ["$B:1"] + tail),
      special_tokens=[e for e in (bos, eos) if e is not None])


def special_token_ids(tokenizer_json: str) -> dict[str, int]:
  """{content: id} of the added tokens marked special in a tokenizer.json string."""
  return {t["content"]: t["id"] for t in json.loads(tokenizer_json)["added_tokens"]
          if t.get("special")}
