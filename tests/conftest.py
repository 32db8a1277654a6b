import os

import pytest

# Tests run on the CPU (and keep XLA from grabbing every core of a small CI machine twice),
# except with MOEJAX_GPU_TESTS=1: then JAX picks its own platform (or JAX_PLATFORMS, if set)
# and the `gpu`-marked tests run on the GPU (`make test-gpu`).
if os.environ.get("MOEJAX_GPU_TESTS") != "1":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_runtest_setup(item):
  """`gpu`-marked tests skip, not fail, where JAX's default backend is not a GPU."""
  if item.get_closest_marker("gpu") is None:
    return
  import jax
  backend = jax.default_backend()
  if backend != "gpu":
    pytest.skip(f"needs a GPU (jax default backend: {backend}); run with MOEJAX_GPU_TESTS=1 "
                "on a machine with one (make test-gpu)")
