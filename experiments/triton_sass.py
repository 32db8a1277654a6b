"""Registers, spills and hot-loop instruction mix of a Pallas-Triton kernel, on a CPU machine.

Lowers the kernel for CUDA without a GPU (jax's cross-platform lowering), takes the
Triton IR that Pallas builds, compiles it for sm_90 with the `triton` pip package
and disassembles it with the cuobjdump that package carries. No device time; the
numbers are from upstream Triton, not the Triton inside jaxlib, so treat them as
a close guide, and time on the GPU before claiming anything.

Setup (once; a separate venv keeps triton out of the project's):
  python3 -m venv /tmp/tv && /tmp/tv/bin/pip install triton
Usage:
  JAX_PLATFORMS=cpu python experiments/triton_sass.py decode --outliers 0.02 --num-warps 2
  JAX_PLATFORMS=cpu python experiments/triton_sass.py decode --kw '{"slots_per_step": 2}'
  (add --triton-python /tmp/tv/bin/python if that is where triton lives;
  SASS_DIR=/some/dir keeps the .ttir/.ttgir/.ptx/.cubin there instead of a temp dir)
"""
from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import lowering as triton_lowering

_COMPILE = r'''
import sys, json
import triton
from triton.backends.compiler import GPUTarget
src, nw, ns, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw, "num_stages": ns})
open(out + ".ptx", "w").write(k.asm["ptx"])
open(out + ".cubin", "wb").write(k.asm["cubin"])
open(out + ".ttgir", "w").write(k.asm["ttgir"])
import os; print(os.path.dirname(triton.__file__))
'''


def capture_ttir(fn, *args) -> str:
  """Triton IR text of the (single) pallas_call inside fn(*args), lowered for CUDA."""
  seen = []
  orig = triton_lowering.lower_jaxpr_to_triton_module

  def spy(*a, **k):
    res = orig(*a, **k)
    seen.append(res.module.operation.get_asm(enable_debug_info=False))
    return res

  triton_lowering.lower_jaxpr_to_triton_module = spy
  try:
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  finally:
    triton_lowering.lower_jaxpr_to_triton_module = orig
  if not seen:
    raise RuntimeError("no Pallas-Triton kernel was lowered")
  return seen[-1]


def loop_mix(sass: str):
  """[(n_instructions, Counter of opcodes)] for every backward branch (loop) in the SASS."""
  ins = []
  for line in sass.splitlines():
    m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
    if m:
      ins.append((int(m.group(1), 16), m.group(2).strip()))
  where = {a: i for i, (a, _) in enumerate(ins)}
  loops = []
  for i, (a, text) in enumerate(ins):
    m = re.search(r"BRA\s.*?0x([0-9a-f]+)", text)
    if m and int(m.group(1), 16) < a and int(m.group(1), 16) in where:
      body = ins[where[int(m.group(1), 16)]:i + 1]
      ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in body)
      loops.append((len(body), ops))
  return loops


def decode_kernel_args(outliers, batch=8, kv_heads=8, q_heads=32, head_dim=128, context=32768):
  from pallas_kernels import kv_quant as kq
  cfg = kq.KVQuantConfig(bits=2, group_size=32, outlier_fraction=outliers, residual_window=32)
  kv = jax.eval_shape(lambda: kq.empty_kv(cfg, batch, kv_heads, head_dim, context))
  return jax.ShapeDtypeStruct((batch, q_heads, head_dim), jnp.bfloat16), kv


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("kernel", choices=["decode", "decode_bf16"])
  ap.add_argument("--outliers", type=float, default=0.02)
  ap.add_argument("--num-warps", type=int, default=2)
  ap.add_argument("--num-stages", type=int, default=2)
  ap.add_argument("--kw", default="{}", help="extra keyword arguments, JSON")
  ap.add_argument("--triton-python", default=os.environ.get("TRITON_PYTHON", "/tmp/tv/bin/python"))
  args = ap.parse_args()
  da = importlib.import_module("pallas_kernels.decode_attention")  # the package attribute is the function
  kw = dict(json.loads(args.kw), num_warps=args.num_warps, num_stages=args.num_stages, interpret=False)
  if args.kernel == "decode":
    q, kv = decode_kernel_args(args.outliers)
    ttir = capture_ttir(lambda q, kv: da.decode_attention(q, kv, **kw), q, kv)
  else:
    q = jax.ShapeDtypeStruct((8, 32, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((8, 8, 32768, 128), jnp.bfloat16)
    n = jax.ShapeDtypeStruct((8,), jnp.int32)
    ttir = capture_ttir(lambda q, k, v, n: da.decode_attention_bf16(q, k, v, n, **kw), q, k, k, n)
  with tempfile.TemporaryDirectory() as tmp:
    tmp = os.environ.get("SASS_DIR", tmp)
    src, out = os.path.join(tmp, "k.ttir"), os.path.join(tmp, "k")
    open(src, "w").write(ttir)
    tdir = subprocess.run([args.triton_python, "-c", _COMPILE, src, str(args.num_warps),
                           str(args.num_stages), out], check=True, capture_output=True,
                          text=True).stdout.strip().splitlines()[-1]
    nvbin = os.path.join(tdir, "backends", "nvidia", "bin")
    ptxas = subprocess.run([os.path.join(nvbin, "ptxas"), "-arch=sm_90a", "-v", out + ".ptx",
                            "-o", out + ".o"], capture_output=True, text=True)
    print(" ".join(l.split("ptxas info    : ")[-1] for l in ptxas.stderr.splitlines()
                   if "registers" in l or "spill" in l))
    sass = subprocess.run([os.path.join(nvbin, "cuobjdump"), "-sass", out + ".cubin"],
                          check=True, capture_output=True, text=True).stdout
    for n, ops in loop_mix(sass):
      print(f"loop: {n} instructions/warp/iteration: " +
            ", ".join(f"{k} {v}" for k, v in ops.most_common(16)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
