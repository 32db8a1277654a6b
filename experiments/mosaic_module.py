"""Print the Mosaic GPU module of the quantized decode kernel, lowered for CUDA on a CPU machine.

No GPU needed. Diff the output of two trees to check that a refactor leaves the kernel
unchanged (locations are left out, so moved source lines do not count):
  JAX_PLATFORMS=cpu PYTHONPATH=. python experiments/mosaic_module.py > /tmp/new.mlir
  (cd OTHER_TREE && JAX_PLATFORMS=cpu PYTHONPATH=. python .../mosaic_module.py) > /tmp/old.mlir
Options are passed to decode_attention_mgpu as JSON: --kw '{"outliers_in_mma": true}'.
For many layouts and options at once (hashes), see mosaic_module_sweep.py.
"""
import argparse
import json

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import core as mosaic_core
from jax.interpreters import mlir

from pallas_kernels import decode_attention_mgpu as dm
from pallas_kernels import kv_quant as kq


def mosaic_module_text(fn, *args):
  """The (last) Mosaic GPU module that lowering ``jax.jit(fn)(*args)`` for CUDA produces,
  as text without locations. Works on a CPU-only machine."""
  modules = []
  rule = mosaic_core._mosaic_gpu_lowering_rule

  def spy(ctx, *a, module, **kw):
    modules.append(module.operation.get_asm(enable_debug_info=False))
    return rule(ctx, *a, module=module, **kw)

  mosaic_core._mosaic_gpu_lowering_rule = spy          # looked up by name at lowering time
  mlir.register_lowering(mosaic_core.mosaic_gpu_p, spy, "cuda")
  try:
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  finally:
    mosaic_core._mosaic_gpu_lowering_rule = rule
    mlir.register_lowering(mosaic_core.mosaic_gpu_p, rule, "cuda")
  return modules[-1]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--bits", type=int, default=2)
  ap.add_argument("--outliers", type=float, default=0.02)
  ap.add_argument("--kw", default="{}")
  a = ap.parse_args()
  cfg = kq.KVQuantConfig(bits=a.bits, group_size=32, outlier_fraction=a.outliers)
  kv = jax.eval_shape(lambda: kq.empty_kv(cfg, 8, 8, 128, 32768))
  q = jax.ShapeDtypeStruct((8, 32, 128), jnp.bfloat16)
  kw = json.loads(a.kw)
  print(mosaic_module_text(lambda q, kv: dm.decode_attention_mgpu(q, kv, sm_scale=128 ** -0.5, **kw),
                           q, kv))


if __name__ == "__main__":
  main()
