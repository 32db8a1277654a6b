"""The real SmolLM2-135M-Instruct GGUF (Q4_1) imported by `moejax import`, against transformers
loading the same file (reference logits from make_gguf_reference.py). Skipped without the
.gguf and the reference files in .gguf/ (git-ignored)."""
from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from moejax.convert import import_model  # noqa: E402
from moejax.inference import load_trained  # noqa: E402

FOLDER = Path(__file__).resolve().parents[2] / ".gguf"
GGUF = FOLDER / "SmolLM2-135M-Instruct.Q4_1.gguf"
REF_LOGITS = FOLDER / "smollm2_ref_logits.npy"
REF_IDS = FOLDER / "smollm2_ref_ids.npy"
REF_TEXT = FOLDER / "smollm2_ref_text.txt"
TOLERANCE = 1e-3   # relative, float32; measured 7.7e-6 (max |diff| 3.1e-4, max |ref| 39.8)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not all(p.is_file() for p in (GGUF, REF_LOGITS, REF_IDS, REF_TEXT)),
                       reason=f"SmolLM2 GGUF or reference files not in {FOLDER}"),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  run = tmp_path_factory.mktemp("smollm2") / "run"
  import_model(GGUF, run, dtype="float32")
  return load_trained(run)


def test_logits_match_transformers(model):
  ids = np.load(REF_IDS).astype(np.int32)
  ref = np.load(REF_LOGITS)
  logits_BTV, _, _ = model.module()(jnp.asarray(ids[None]))
  ours = np.asarray(logits_BTV, np.float32)[0]
  assert ours.shape == ref.shape
  diff = np.abs(ours - ref)
  max_rel = float(diff.max() / np.abs(ref).max())
  row_rel = np.linalg.norm(ours - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
  print(f"SmolLM2 logits: T={len(ids)} max|diff|={diff.max():.3g} max|ref|={np.abs(ref).max():.3g} "
        f"max rel={max_rel:.3g}; per-position rel L2 max={row_rel.max():.3g} "
        f"mean={row_rel.mean():.3g}; argmax agree {np.mean(ours.argmax(-1) == ref.argmax(-1)):.4f}")
  assert max_rel < TOLERANCE
  assert float(row_rel.max()) < TOLERANCE


def test_tokenizer_gives_the_reference_ids(model):
  text = REF_TEXT.read_text(encoding="utf-8")
  np.testing.assert_array_equal(model.tokenizer.encode(text), np.load(REF_IDS))
