"""Plain ``jnp`` versions of every kernel in ``pallas_kernels``: the ground truth.

Tests compare each Pallas kernel against the function of the same name here.
Nothing in this file is meant to be fast.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# --- packing / KV quantization / decode attention -------------------------


# --- grouped matmul ---------------------------------------------------------
