"""Why does loop_descriptors change nothing on the GPU machine's jax? Logs, in order, when
our lowering hooks run and when jax calls wgmma_m64 (with the MLIR context each sees), then
counts the descriptor movs in the module Pallas hands to Mosaic. Compile only, no GPU run.
  PYTHONPATH=. python experiments/diag_loop_descriptors.py
"""
import inspect
import re
import traceback

import jax
import jax.numpy as jnp
from jax._src.lib.mlir import ir

from experiments.mosaic_module import mosaic_module_text
from pallas_kernels import decode_attention_mgpu as dm
from pallas_kernels import kv_quant as kq

events = []
orig = dm.mgpu_wgmma.wgmma_m64


def logged(*args, **kwargs):
  if not any(e[0] == "wgmma_m64" for e in events):
    print("first wgmma_m64 call from:\n" + "".join(traceback.format_stack(limit=14)[:-1]), flush=True)
  events.append(("wgmma_m64", id(ir.Context.current), hasattr(dm.mgpu_wgmma.wgmma_m64, "moejax_original")))
  return orig(*args, **kwargs)


dm.mgpu_wgmma.wgmma_m64 = logged
hook = dm._descriptors_in_loop


def logged_hook(on):
  events.append(("hook on" if on else "hook off", id(ir.Context.current)))
  return hook(on)


dm._descriptors_in_loop = logged_hook
print("jax", jax.__version__, flush=True)
from jax._src.pallas.mosaic_gpu import primitives
src = inspect.getsource(primitives)
for m in re.finditer(r".*(mgpu\.wgmma|dialect\.wgmma|lowering_semantics).*", src):
  print("primitives:", m.group(0).strip())
print("wgmma.py calls:", [l.strip() for l in inspect.getsource(dm.mgpu_wgmma).splitlines() if "wgmma_m64(" in l])
cfg = kq.KVQuantConfig(bits=2, group_size=32, outlier_fraction=0.02)
kv = jax.eval_shape(lambda: kq.empty_kv(cfg, 2, 8, 128, 4096))
q = jax.ShapeDtypeStruct((2, 32, 128), jnp.bfloat16)
for ld in (False, True):
  events.clear()
  text = mosaic_module_text(lambda q, kv: dm.decode_attention_mgpu(q, kv, sm_scale=128 ** -0.5,
                                                                   loop_descriptors=ld), q, kv)
  kinds = [e[0] if e[0] != "wgmma_m64" else f"wgmma(wrapped={e[2]})" for e in events]
  compact = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
  print(f"loop_descriptors={ld}: movs in module {text.count('mov.b64 $0, $1;')}, "
        f"wgmma calls {kinds.count('wgmma(wrapped=True)') + kinds.count('wgmma(wrapped=False)')}, "
        f"order {compact}, contexts {sorted(set(e[1] for e in events))}", flush=True)
