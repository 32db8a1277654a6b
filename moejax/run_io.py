"""What a run directory holds besides checkpoints: config, tokenizer, data set-up."""
from __future__ import annotations

from pathlib import Path

from moejax.config import Config
from moejax.data import (ByteTokenizer, HFTokenizer, SentencePieceTokenizer, TokenDataset,
                         Tokenizer, build_tokenizer, load_corpus)

TOKENIZER_FILE = "tokenizer.model"      # data.tokenizer bpe (SentencePiece)
HF_TOKENIZER_FILE = "tokenizer.json"    # data.tokenizer hf (Hugging Face tokenizers)
TOKENIZER_FILES = (TOKENIZER_FILE, HF_TOKENIZER_FILE)


def _hf_tokenizer(cfg: Config, run_dir: Path | None) -> HFTokenizer:
  """The run's tokenizer.json; a new run takes data.tokenizer_file and keeps a copy."""
  saved = Path(run_dir) / HF_TOKENIZER_FILE if run_dir else None
  if saved is not None and saved.is_file():
    return HFTokenizer.from_file(saved, cfg.data.eos_id)
  if not cfg.data.tokenizer_file:
    raise FileNotFoundError(f"data.tokenizer=hf: no {saved or HF_TOKENIZER_FILE} and no "
                            "data.tokenizer_file (a Hugging Face tokenizer.json) to start from")
  tok = HFTokenizer.from_file(cfg.data.tokenizer_file, cfg.data.eos_id)
  if saved is not None:
    tok.save(saved)
  return tok


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
  elif d.tokenizer == "hf":
    tok = _hf_tokenizer(cfg, run_dir)
  else:
    tok = build_tokenizer("byte")
  return TokenDataset.build(corpus, tok)


def load_tokenizer(cfg: Config, run_dir: Path) -> Tokenizer:
  if cfg.data.tokenizer == "byte":
    return ByteTokenizer()
  if cfg.data.tokenizer == "hf":
    return _hf_tokenizer(cfg, run_dir)
  return SentencePieceTokenizer.from_file(Path(run_dir) / TOKENIZER_FILE)
