"""One way to choose a kernel implementation, shared by every op (tokamax-style).

An op's public function takes ``implementation``: ``None`` (the op's default order for
the device jax runs on), one name, or an ordered sequence of names. The names are tried
in order; an implementation that cannot take the inputs raises ``Unsupported`` before it
does any work, and the next one is tried. When none can, the error lists every reason.

Tuning knobs live in one frozen ``Config`` dataclass per implementation, passed as
``config=``; with several names, a config goes to the implementation it belongs to and
the others run with their defaults.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax


class Unsupported(ValueError):
  """Raised by an implementation that cannot take these inputs (the next one is tried)."""


def platform() -> str:
  """'gpu', 'tpu' or 'cpu': the platform of jax's default device."""
  backend = jax.default_backend()
  return "gpu" if backend in ("gpu", "cuda", "rocm") else backend


def resolve_interpret(interpret: bool | None) -> bool:
  """``None``: interpret mode unless an accelerator with a Pallas lowering is present."""
  if interpret is not None:
    return bool(interpret)
  return platform() not in ("gpu", "tpu")


def is_hopper() -> bool:
  """Whether jax's default device is a Hopper GPU (compute capability 9.x)."""
  dev = jax.devices()[0]
  return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def names_to_try(op: str, implementation: str | Sequence[str] | None, known: Sequence[str],
                 default: Callable[[], Sequence[str]]) -> tuple[str, ...]:
  """The implementations to try, in order; unknown names are a clear error."""
  if implementation is None:
    names = tuple(default())
  elif isinstance(implementation, str):
    names = (implementation,)
  else:
    names = tuple(implementation)
  if not names:
    raise ValueError(f"{op}: implementation must name at least one of {', '.join(known)}")
  for name in names:
    if name not in known:
      raise ValueError(f"{op}: unknown implementation {name!r}; choose from {', '.join(known)}")
  return names


def dispatch(op: str, implementations: Mapping[str, Callable[..., Any]],
             implementation: str | Sequence[str] | None, default: Callable[[], Sequence[str]],
             config: Any, configs: Mapping[str, type], *args, **kwargs):
  """Runs the first implementation that takes the inputs.

  ``implementations[name](*args, config=..., **kwargs)`` raises ``Unsupported`` when it
  cannot take the inputs. ``configs[name]`` is the Config class of that implementation:
  ``config`` goes to the implementation whose class it is (others get their default).
  """
  names = names_to_try(op, implementation, tuple(implementations), default)
  if config is not None and not any(isinstance(config, configs[n]) for n in names if n in configs):
    raise ValueError(f"{op}: config {type(config).__name__} belongs to none of the "
                     f"implementations tried ({', '.join(names)})")
  reasons = []
  for name in names:
    cls = configs.get(name)
    cfg = config if cls is not None and isinstance(config, cls) else (cls() if cls else None)
    try:
      return implementations[name](*args, config=cfg, **kwargs)
    except Unsupported as e:
      reasons.append(f"{name}: {e}")
  raise Unsupported(f"{op}: no implementation takes these inputs ({'; '.join(reasons)})")
