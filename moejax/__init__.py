"""moejax: Mixture-of-Experts language models in JAX (Flax NNX), kernels in pallas_kernels.

Array names end in their shape, one letter per axis, one meaning per letter:

  B batch                 T tokens / query positions     S key-value positions
  D model width           F expert / FFN hidden width    V vocab
  E experts               C capacity slots per expert    K routed slots per token (top_k / max_k)
  L layers                H query heads                  N kv heads
  G query heads per kv-head                              A attention head dim

Sink tokens are spelled `sink`, never S. A module that needs more letters says so in its
docstring (e.g. parallel/dispatch.py). Parameter names are checkpoint keys and keep their
historic spelling (the attention weights wq_DHd, wk_DKd, wv_DKd, wo_HdD).
"""
