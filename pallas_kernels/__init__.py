"""pallas_kernels: reusable Pallas kernels (sub-byte packing, quantized-KV decode attention, grouped matmul).

Imports jax and numpy only — never moejax.
"""

# --- grouped matmul (experts) ---
from pallas_kernels.gmm import gmm, tgmm  # noqa: E402
from pallas_kernels.gmm_plan import GmmTiling, default_tiling  # noqa: E402
from pallas_kernels.gmm_quant import (  # noqa: E402
    QuantizedExpertWeights, dequantize_expert_weights, quantize_expert_weights)
