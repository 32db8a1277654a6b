"""Compiled (GPU) quantized decode attention vs the float32 reference, every bit width and axis.

The CPU test suite runs the kernel in interpret mode, where the dequantization is
plain jnp; this script checks the inline-PTX path the GPU compiles.
Usage (device machine): PYTHONPATH=. python3 experiments/check_decode_gpu.py [--quick] [--mosaic]
[--no-inplace] [--explicit-barriers] [--merged-barriers] [--loop-descriptors] [--no-early] [--warp-mma] [--wgmma] [--bits=2,3] [--fracs=0.0,0.02]
[--ratios=1,4,16] (outlier fractions; query heads per kv-head, default 4)
(--mosaic: the Mosaic GPU kernel, on the layouts it supports; --no-inplace: in_place_codes=False;
--explicit-barriers, --merged-barriers: those options True; --loop-descriptors: loop_descriptors=True; --no-early:
early_fetch=False; --warp-mma: warp_mma=True; --wgmma: warp_mma=False; options not given keep the module's defaults)
"""
import itertools
import sys

import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_quant as kq
from pallas_kernels import reference
from pallas_kernels import decode_attention_mgpu as mgpu
from pallas_kernels.decode_attention import decode_attention


def rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main():
  worst = 0.0
  rng = np.random.default_rng(0)
  quick = "--quick" in sys.argv          # one group size, two outlier fractions
  backend = "mosaic" if "--mosaic" in sys.argv else "triton"
  arg = lambda name, default: next((a.split("=", 1)[1] for a in sys.argv if a.startswith(f"--{name}=")),
                                  default)
  bits_arg = arg("bits", "2,3,4,8")
  fracs = arg("fracs", "0.02,0.03,0.15" if quick else "0.0,0.02,0.03,0.15")
  cases = itertools.product(tuple(int(x) for x in bits_arg.split(",")), ((32, 32, 4),) if quick else ((16, 0, 0), (32, 32, 4), (64, 64, 0)),
                            (("channel", "token"), ("token", "channel")),
                            tuple(float(x) for x in fracs.split(",")),
                            tuple(int(x) for x in arg("ratios", "4").split(",")))
  for bits, (g, r, s), (ka, va), frac, ratio in cases:
    b, h, d, t = 3, 2, 128, 1000
    k = rng.normal(size=(b, h, t, d)) * np.exp(0.5 * rng.normal(size=(1, h, 1, d)))
    v = rng.normal(size=(b, h, t, d))
    q = jnp.asarray(rng.normal(size=(b, h * ratio, d)), jnp.bfloat16)
    cfg = kq.KVQuantConfig(bits=bits, group_size=g, residual_window=r, sink_tokens=s,
                           key_axis=ka, value_axis=va, outlier_fraction=frac)
    lengths = jnp.array([t, 517, 3])
    cache = kq.quantize_kv(jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), cfg,
                           max_len=1024, lengths=lengths)
    if backend == "mosaic" and not mgpu.supports(cache.layout, ratio):
      continue
    flags = {"--no-inplace": ("in_place_codes", False), "--explicit-barriers": ("explicit_barriers", True),
             "--merged-barriers": ("merged_barriers", True),
             "--loop-descriptors": ("loop_descriptors", True),
             "--no-early": ("early_fetch", False), "--warp-mma": ("warp_mma", True),
             "--wgmma": ("warp_mma", False)}
    kw = dict(v for f, v in flags.items() if f in sys.argv)
    if backend == "mosaic" and kw:
      out = mgpu.decode_attention_mgpu(q, cache, sm_scale=d ** -0.5, **kw)
    else:
      out = decode_attention(q, cache, backend=backend)
    ref = reference.quantized_decode_attention(q, cache)
    e = rel(out, ref)
    worst = max(worst, e)
    flag = "" if e < 1e-2 else "  <-- FAIL"
    print(f"bits={bits} G={g} R={r} S={s} k={ka} v={va} outliers={frac} heads/kv={ratio}: "
          f"rel err {e:.2e}{flag}",
          flush=True)
  print(f"worst {worst:.2e}")
  return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
  sys.exit(main())
