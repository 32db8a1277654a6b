"""Decode attention on a quantized (or bf16) KV cache: ``api.decode_attention``.

Files: ``api.py`` (checks, choice of implementation), ``mosaic_gpu.py`` (+ ``_ptx``,
``_smem``: the Hopper kernel), ``merge_triton.py`` (its merge kernel), ``triton.py``, ``triton_bf16.py``,
``tpu.py``, ``xla.py``, ``merge.py`` (partials merged in jnp), ``reference.py`` (tests only).
"""
from pallas_kernels.decode_attention.api import decode_attention, decode_attention_bf16, default_order
from pallas_kernels.decode_attention.merge_triton import MergeConfig
from pallas_kernels.decode_attention.mosaic_gpu import MosaicGpuConfig
from pallas_kernels.decode_attention.triton import TritonConfig
from pallas_kernels.decode_attention.triton_bf16 import TritonBf16Config

__all__ = ["decode_attention", "decode_attention_bf16", "default_order", "MergeConfig",
           "MosaicGpuConfig", "TritonBf16Config", "TritonConfig"]
