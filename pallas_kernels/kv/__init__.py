"""The quantized KV cache: sub-byte packing (``packing``), the layout every kernel reads
(``layout``), group-wise min/max quantization (``groups``), the quantizer and ``QuantizedKV``
(``quant``); ``reference`` for tests."""
from pallas_kernels.kv.layout import KVLayout, KVQuantConfig
from pallas_kernels.kv.packing import codes_per_word, pack, pack_jnp, padded_length, unpack, unpack_jnp
from pallas_kernels.kv.quant import (
    QuantizedKV, append_kv, empty_kv, kv_bits_per_element, quantize_kv, select_outlier_channels)

__all__ = ["KVLayout", "KVQuantConfig", "QuantizedKV", "append_kv", "codes_per_word", "empty_kv",
           "kv_bits_per_element", "pack", "pack_jnp", "padded_length", "quantize_kv",
           "select_outlier_channels", "unpack", "unpack_jnp"]
