"""Grouped (ragged) matmul for Mixture-of-Experts: ``gmm``, ``tgmm``, quantized expert weights.

Shapes: M rows sorted by group, I contraction, O output width, E experts, Q quantization
groups along I.

* ``gmm(lhs [M, I], rhs [E, I, O] | QuantizedExpertWeights, group_sizes [E], *,
  preferred_element_type=None, implementation=None, config=None, interpret=None)
  -> [M, O]``; differentiable (custom VJPs).
* ``tgmm(lhs [I, M], rhs [M, O], group_sizes [E], ...) -> [E, I, O]``.
* ``implementation``: "triton" | "tpu" | "xla" or an ordered sequence; default
  ("tpu", "xla") on a TPU, else ("triton", "xla"). ``config``: ``TritonConfig``
  (alias ``GmmTiling``; ``default_tiling`` is its heuristic) or ``TpuConfig``.
* ``quantize_expert_weights(w [E, I, O], bits=8|4, group_size=None)``,
  ``dequantize_expert_weights``, ``QuantizedExpertWeights`` (layout: quant.py).

Modules: api (public functions), plan (configs, work tiles), triton / tpu (Pallas
kernels), xla (ragged_dot), quant, reference (plain jnp; tests only).
Note: the package attribute ``pallas_kernels.gmm`` is the function; reach the modules
with ``from pallas_kernels.gmm import api`` or ``importlib.import_module``.
"""
from pallas_kernels.gmm.api import IMPLEMENTATIONS, gmm, tgmm
from pallas_kernels.gmm.plan import GmmTiling, TpuConfig, TritonConfig, default_tiling
from pallas_kernels.gmm.quant import (
    QuantizedExpertWeights, dequantize_expert_weights, quantize_expert_weights)

__all__ = ["IMPLEMENTATIONS", "GmmTiling", "QuantizedExpertWeights", "TpuConfig",
           "TritonConfig", "default_tiling", "dequantize_expert_weights", "gmm",
           "quantize_expert_weights", "tgmm"]
