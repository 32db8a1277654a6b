"""What a run directory holds besides checkpoints: config, tokenizer, data set-up."""
from __future__ import annotations

from pathlib import Path

from moejax.config import Config
from moejax.data import (ByteTokenizer, SentencePieceTokenizer, TokenDataset, Tokenizer,
                         build_tokenizer, load_corpus)

TOKENIZER_FILE = "tokenizer.model"


def load_data(cfg: Config, run_dir: Path | None = None) -> TokenDataset:
  """Corpus + tokenizer from the config; a BPE model is saved into run_dir for reuse."""
  d = cfg.data
  if d.corpus == "shakespeare":
    corpus = load_corpus()
  else:
    corpus = load_corpus(list(d.files), list(d.val_files) or None, d.val_fraction)
  if d.tokenizer == "bpe":
    saved = run_dir / TOKENIZER_FILE if run_dir else None
    tok = (SentencePieceTokenizer.from_file(saved) if saved and saved.is_file()
           else build_tokenizer("bpe", d.bpe_vocab_size, corpus.train_text))
    if saved and not saved.is_file():
      saved.parent.mkdir(parents=True, exist_ok=True)
      tok.save(saved)
  else:
    tok = build_tokenizer("byte")
  return TokenDataset.build(corpus, tok)


def load_tokenizer(cfg: Config, run_dir: Path) -> Tokenizer:
  if cfg.data.tokenizer == "byte":
    return ByteTokenizer()
  return SentencePieceTokenizer.from_file(Path(run_dir) / TOKENIZER_FILE)
