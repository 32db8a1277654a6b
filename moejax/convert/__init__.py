"""Importing checkpoints of other frameworks (Hugging Face folders, GGUF files) as moejax
runs. The stable entry point for every front end: import_checkpoint (importer.py)."""
from moejax.convert.importer import TensorShapeError, TensorSource, import_checkpoint
from moejax.convert.mapping import ARCHITECTURES, UnsupportedModelError

__all__ = ["ARCHITECTURES", "TensorShapeError", "TensorSource", "UnsupportedModelError",
           "import_checkpoint", "import_model"]


def __getattr__(name):   # import_model lazily: hf.py pulls in safetensors
  if name == "import_model":
    from moejax.convert.hf import import_model
    return import_model
  raise AttributeError(name)
