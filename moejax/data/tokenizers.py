"""Tokenizers with one interface: bytes (vocab 256), a SentencePiece BPE, and a
Hugging Face tokenizer.json (`hf`, what `moejax import` brings along).

The first two round-trip any text exactly (decode(encode(s)) == s); every kind
gives the number of UTF-8 bytes each token decodes to (`token_bytes`; for `hf`
exact for byte-level and byte-fallback vocabularies), so that evaluation can
report bits per byte on exactly the tokens it scored:

  bits_per_byte = total_nll_nats / ln(2) / tokenizer.byte_count(targets)
"""

from __future__ import annotations

import hashlib
import io
import math
import os
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from moejax.atomic import write_atomic
from moejax.data.corpus import default_cache_root

# Bumped whenever the BPE training options change, so old caches are not reused.
_BPE_RECIPE = "bpe-v1"
_NEWLINE = "\n"
# Pieces that exist before any merge: <unk>, "\n" and the 256 byte pieces.
_BPE_BASE_PIECES = 258


@runtime_checkable
class Tokenizer(Protocol):
  """What the rest of moejax needs from a tokenizer."""
  name: str
  vocab_size: int
  token_bytes: np.ndarray  # [vocab_size] int64: UTF-8 bytes each id decodes to.

  def encode(self, text: str) -> np.ndarray:  # -> [N] int32
    ...

  def decode(self, ids) -> str:
    ...

  def byte_count(self, ids) -> int:
    ...


def bits_per_byte(total_nll_nats: float, total_bytes: int) -> float:
  """Converts a summed negative log-likelihood (nats) to bits per UTF-8 byte."""
  if total_bytes <= 0:
    raise ValueError(f"total_bytes must be positive, got {total_bytes}")
  return float(total_nll_nats) / math.log(2.0) / float(total_bytes)


def _as_ids(ids, vocab_size: int) -> np.ndarray:
  arr = np.asarray(ids)
  if arr.size and not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
  arr = arr.astype(np.int64).reshape(-1)
  if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
    raise ValueError(f"token ids must be in [0, {vocab_size}), got range "
                     f"[{arr.min()}, {arr.max()}]")
  return arr


class _ByteCounting:
  vocab_size: int
  token_bytes: np.ndarray

  def byte_count(self, ids) -> int:
    """UTF-8 bytes that `ids` (any shape) decode to, summed."""
    return int(self.token_bytes[_as_ids(ids, self.vocab_size)].sum())


class ByteTokenizer(_ByteCounting):
  """Token = one UTF-8 byte; vocab 256. Exact for any text, no training."""

  def __init__(self):
    self.name = "byte"
    self.vocab_size = 256
    self.token_bytes = np.ones(256, np.int64)

  def encode(self, text: str) -> np.ndarray:
    """str -> [num_bytes] int32."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    """Ids -> str; byte sequences that are not valid UTF-8 become U+FFFD."""
    return _as_ids(ids, 256).astype(np.uint8).tobytes().decode(
        "utf-8", errors="replace")


class SentencePieceTokenizer(_ByteCounting):
  """A SentencePiece BPE model trained for exact round trips.

  Trained with identity normalization, no dummy prefix, no whitespace
  collapsing, byte fallback and "\\n" as its own piece, so any text (also
  characters unseen in training) encodes and decodes back unchanged.
  """

  def __init__(self, model_proto: bytes, name: str = "bpe"):
    import sentencepiece as spm  # Imported here: byte-only users skip it.
    self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
    self.model_proto = bytes(model_proto)
    self.name = name
    self.vocab_size = int(self._sp.get_piece_size())
    self._newline = self._sp.piece_to_id(_NEWLINE)
    # Byte pieces decode to one byte each; the rest to their decoded text
    # (no dummy prefix is stripped, see the training options).
    self.token_bytes = np.array(
        [1 if self._sp.is_byte(i) else len(self._sp.decode([i]).encode())
         for i in range(self.vocab_size)], np.int64)

  @classmethod
  def from_file(cls, path: str | os.PathLike) -> "SentencePieceTokenizer":
    path = Path(path)
    if not path.is_file():
      raise FileNotFoundError(f"SentencePiece model not found: {path}")
    return cls(path.read_bytes(), name=path.stem)

  def save(self, path: str | os.PathLike) -> None:
    """Writes the model (e.g. next to a checkpoint); load with from_file."""
    write_atomic(Path(path), self.model_proto)

  @classmethod
  def train(cls, text: str, vocab_size: int,
            cache_dir: str | os.PathLike | None = None
            ) -> "SentencePieceTokenizer":
    """Trains a BPE on `text`, or reuses the one cached for (text, vocab_size).

    cache_dir defaults to $MOEJAX_CACHE/tokenizers. The vocabulary may come
    out smaller than asked when the text is small; read `.vocab_size`.
    """
    if not text.strip():
      raise ValueError("cannot train a BPE tokenizer on empty text")
    # Every distinct character of the text (but "\n") also gets a piece.
    needed = _BPE_BASE_PIECES + len(set(text) - {_NEWLINE})
    if vocab_size <= needed:
      raise ValueError(
          f"bpe vocab_size must exceed {needed} for this text (unk, newline, "
          f"256 byte-fallback pieces and one per distinct character), got "
          f"{vocab_size}")
    digest = hashlib.sha256(
        f"{_BPE_RECIPE}\0{vocab_size}\0".encode() + text.encode()).hexdigest()
    name = f"bpe{vocab_size}-{digest[:12]}"
    cache = Path(cache_dir).expanduser() if cache_dir else (
        default_cache_root() / "tokenizers")
    path = cache / f"{name}.model"
    if path.is_file():
      return cls(path.read_bytes(), name=name)
    proto = _train_bpe(text, vocab_size)
    write_atomic(path, proto)
    return cls(proto, name=name)

  def encode(self, text: str) -> np.ndarray:
    """str -> [num_tokens] int32."""
    # "\n" is a user-defined piece, so no piece spans a line break: encoding
    # line by line (multi-threaded) equals encoding the whole text, faster.
    lines = text.split(_NEWLINE)
    pieces = self._sp.encode(lines, num_threads=os.cpu_count() or 1)
    out: list[int] = []
    for i, line_ids in enumerate(pieces):
      if i:
        out.append(self._newline)
      out.extend(line_ids)
    return np.asarray(out, np.int32)

  def decode(self, ids) -> str:
    return self._sp.decode(_as_ids(ids, self.vocab_size).tolist())


def _byte_level_decoder() -> dict[str, int]:
  """GPT-2's byte-level alphabet: printable character -> the byte it stands for."""
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
               + list(range(ord("®"), ord("ÿ") + 1)))
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[chr(b)] = b
    else:
      chars[chr(256 + extra)] = b
      extra += 1
  return chars


def _piece_bytes(piece: str, byte_level: dict[str, int] | None, decoded: str) -> int:
  """UTF-8 bytes of one vocabulary piece: byte-level pieces map character by character to
  bytes, byte-fallback pieces (<0xNN>) are one byte; others count what they decode to."""
  if byte_level is not None and all(ch in byte_level for ch in piece):
    return len(piece)
  if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
    return 1
  if "\u2581" in piece:   # SentencePiece's word marker: a space (decode drops a leading one)
    return len(piece.replace("\u2581", " ").encode("utf-8"))
  return len(decoded.encode("utf-8"))


class HFTokenizer(_ByteCounting):
  """A Hugging Face `tokenizers` tokenizer.json (kept as is in the run directory).

  encode adds no special tokens (a corpus encodes as the concatenation of its parts);
  special tokens (added tokens marked special) count 0 bytes. eos_id: the end-of-text id
  (data.eos_id, from the imported config.json), -1 when there is none.
  """

  def __init__(self, tokenizer_json: str, eos_id: int = -1, name: str = "hf"):
    from tokenizers import Tokenizer as _HFTokenizer  # imported here: other kinds skip it
    self._tok = _HFTokenizer.from_str(tokenizer_json)
    self.tokenizer_json = tokenizer_json
    self.name = name
    self.eos_id = int(eos_id)
    self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
    byte_level = _byte_level_decoder() if '"ByteLevel"' in tokenizer_json else None
    special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
    sizes = np.zeros(self.vocab_size, np.int64)
    for i in range(self.vocab_size):
      piece = self._tok.id_to_token(i)
      if piece is None or piece in special:
        continue
      sizes[i] = _piece_bytes(piece, byte_level, self._tok.decode([i], skip_special_tokens=False))
    self.token_bytes = sizes

  @classmethod
  def from_file(cls, path: str | os.PathLike, eos_id: int = -1) -> "HFTokenizer":
    path = Path(path)
    if not path.is_file():
      raise FileNotFoundError(f"Hugging Face tokenizer.json not found: {path}")
    return cls(path.read_text(encoding="utf-8"), eos_id)

  def save(self, path: str | os.PathLike) -> None:
    write_atomic(Path(path), self.tokenizer_json)

  def encode(self, text: str) -> np.ndarray:
    """str -> [num_tokens] int32."""
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

  def decode(self, ids) -> str:
    return self._tok.decode(_as_ids(ids, self.vocab_size).tolist(), skip_special_tokens=False)


def _train_bpe(text: str, vocab_size: int) -> bytes:
  import sentencepiece as spm
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(text.split(_NEWLINE)), model_writer=model,
      model_type="bpe", vocab_size=vocab_size, hard_vocab_limit=False,
      normalization_rule_name="identity", remove_extra_whitespaces=False,
      add_dummy_prefix=False, allow_whitespace_only_pieces=True,
      byte_fallback=True, character_coverage=1.0,
      user_defined_symbols=[_NEWLINE],
      unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1,
      input_sentence_size=2_000_000, shuffle_input_sentence=True,
      num_threads=os.cpu_count() or 1, minloglevel=2)
  return model.getvalue()


def build_tokenizer(kind: str, vocab_size: int | None = None,
                    train_text: str | None = None,
                    cache_dir: str | os.PathLike | None = None) -> Tokenizer:
  """kind "byte" (vocab_size None or 256) or "bpe" (trained on train_text)."""
  if kind == "byte":
    if vocab_size not in (None, 256):
      raise ValueError(f"the byte tokenizer has vocab_size 256, got "
                       f"{vocab_size}")
    return ByteTokenizer()
  if kind == "bpe":
    if vocab_size is None or train_text is None:
      raise ValueError("the bpe tokenizer needs vocab_size and train_text")
    return SentencePieceTokenizer.train(train_text, vocab_size, cache_dir)
  raise ValueError(f"unknown tokenizer kind {kind!r}; expected 'byte' or "
                   f"'bpe'")
