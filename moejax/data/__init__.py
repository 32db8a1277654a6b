"""Corpora, tokenizers and batching.

Typical use:
  corpus = load_corpus()                          # built-in Shakespeare
  tok = build_tokenizer("byte")                   # or ("bpe", 2048, corpus.train_text)
  data = TokenDataset.build(corpus, tok)
  for inputs_BT, targets_BT in train_batches(data.train, B, T, seed, start_step):
    ...
  bpb = bits_per_byte(sum_nll_nats, tok.byte_count(all_val_targets))
"""

from moejax.data.batching import Batch
from moejax.data.batching import num_val_batches
from moejax.data.batching import spread_val_batches
from moejax.data.batching import TokenDataset
from moejax.data.batching import train_batch
from moejax.data.batching import train_batches
from moejax.data.batching import val_batches
from moejax.data.corpus import Corpus
from moejax.data.corpus import default_cache_root
from moejax.data.corpus import DOC_SEPARATOR
from moejax.data.corpus import ensure_shakespeare
from moejax.data.corpus import load_corpus
from moejax.data.corpus import load_shakespeare
from moejax.data.corpus import SHAKESPEARE_VAL_PLAYS
from moejax.data.tokenizers import bits_per_byte
from moejax.data.tokenizers import build_tokenizer
from moejax.data.tokenizers import ByteTokenizer
from moejax.data.tokenizers import HFTokenizer
from moejax.data.tokenizers import SentencePieceTokenizer
from moejax.data.tokenizers import Tokenizer

__all__ = [
    "Batch", "bits_per_byte", "build_tokenizer", "ByteTokenizer", "Corpus",
    "default_cache_root", "DOC_SEPARATOR", "ensure_shakespeare", "HFTokenizer",
    "load_corpus", "load_shakespeare", "num_val_batches",
    "SentencePieceTokenizer", "SHAKESPEARE_VAL_PLAYS", "spread_val_batches", "TokenDataset",
    "Tokenizer", "train_batch", "train_batches", "val_batches",
]
