"""pallas_kernels: reusable Pallas kernels (sub-byte packing, quantized-KV decode attention, grouped matmul).

Imports jax and numpy only — never moejax.
"""
