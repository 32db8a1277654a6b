"""Backend choice for Pallas kernels: compiled on GPU/TPU, interpreted on CPU.

Every public kernel takes ``interpret: bool | None``. ``None`` means "decide from
the default backend": CPU has no Pallas lowering, so kernels run in interpret
mode there (this is what CI tests); on GPU and TPU they compile.
"""
from __future__ import annotations

import jax


def backend() -> str:
  """'gpu', 'tpu' or 'cpu' — the platform of jax's default device."""
  return jax.default_backend()


def resolve_interpret(interpret: bool | None) -> bool:
  """Interpret mode unless an accelerator with a Pallas lowering is present."""
  if interpret is not None:
    return bool(interpret)
  return backend() not in ("gpu", "cuda", "rocm", "tpu")
