"""Peak host memory of `moejax import` against the size of what it writes.

Usage (from the repo root; CPU is enough):
  python experiments/import_peak_rss.py [--layers 8] [--d-model 1024] [--ffn 3584]
      [--experts 8] [--vocab 32000] [--dtype bfloat16] [--workdir DIR] [--keep] [--out FILE]

Builds a synthetic Mixtral folder (bf16 safetensors, one shard per layer named by
model.safetensors.index.json, random normal weights) in a temporary directory, runs
`moejax import SRC OUT` in a subprocess and reports that subprocess's peak RSS (ru_maxrss
from os.wait4, i.e. RUSAGE_CHILDREN for that one child) next to: the checkpoint's parameter
bytes, the largest tensor's, the largest layer's (what the streamed writer holds at once),
and the peak RSS of a process that only imports jax, orbax and moejax's import path and
makes the CPU client (the floor any import pays). The defaults: 1.5 GB of bf16 parameters,
a 176 MB MoE layer, tensors of 7-66 MB.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

MiB = 2**20
REPO = Path(__file__).resolve().parent.parent
_BASELINE = ("import jax, orbax.checkpoint, moejax.cli, moejax.convert.hf, safetensors; "
             "jax.devices('cpu')")
_IMPORT = "import sys; from moejax.cli import main; sys.exit(main(sys.argv[1:]))"


def write_mixtral(folder: Path, L: int, D: int, F: int, E: int, V: int) -> dict:
  """A Mixtral HF folder, shard by shard (only one layer's tensors in memory at a time);
  -> tensor sizes in bytes by name."""
  from safetensors.numpy import save_file
  rng = np.random.default_rng(0)
  H, N, A = 8, 2, D // 8
  w = lambda *shape: (0.02 * rng.standard_normal(shape, np.float32)).astype(ml_dtypes.bfloat16)
  shards = [{"model.embed_tokens.weight": w(V, D), "model.norm.weight": w(D),
             "lm_head.weight": w(V, D)}]
  for i in range(L):
    p = f"model.layers.{i}"
    layer = {f"{p}.input_layernorm.weight": w(D), f"{p}.post_attention_layernorm.weight": w(D),
             f"{p}.block_sparse_moe.gate.weight": w(E, D),
             f"{p}.self_attn.q_proj.weight": w(H * A, D), f"{p}.self_attn.o_proj.weight": w(D, H * A),
             f"{p}.self_attn.k_proj.weight": w(N * A, D), f"{p}.self_attn.v_proj.weight": w(N * A, D)}
    for j in range(E):
      for kind, shape in (("w1", (F, D)), ("w3", (F, D)), ("w2", (D, F))):
        layer[f"{p}.block_sparse_moe.experts.{j}.{kind}.weight"] = w(*shape)
    shards.append(layer)
  folder.mkdir(parents=True)
  sizes, weight_map = {}, {}
  for k in range(len(shards)):
    name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
    tensors = shards[k]
    save_file(tensors, str(folder / name))
    sizes.update({t: a.nbytes for t, a in tensors.items()})
    weight_map.update({t: name for t in tensors})
    shards[k] = None   # drop the shard once written
  (folder / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}))
  (folder / "config.json").write_text(json.dumps({
      "architectures": ["MixtralForCausalLM"], "vocab_size": V, "hidden_size": D,
      "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": H,
      "num_key_value_heads": N, "num_local_experts": E, "num_experts_per_tok": 2,
      "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}))
  return sizes


def peak_rss(argv: list[str]) -> tuple[int, float]:
  """(peak RSS in bytes, seconds) of one subprocess; raises if it fails."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
  start = time.time()
  proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
  _, status, usage = os.wait4(proc.pid, 0)
  proc.returncode = os.waitstatus_to_exitcode(status)
  if proc.returncode != 0:
    raise RuntimeError(f"{argv[:4]}... exited with {proc.returncode}")
  return usage.ru_maxrss * 1024, time.time() - start   # Linux: ru_maxrss in KiB


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--d-model", type=int, default=1024)
  ap.add_argument("--ffn", type=int, default=3584)
  ap.add_argument("--experts", type=int, default=8)
  ap.add_argument("--vocab", type=int, default=32000)
  ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  ap.add_argument("--workdir", default=None, help="default: a new temporary directory")
  ap.add_argument("--keep", action="store_true", help="keep the folder and the run")
  ap.add_argument("--out", default=None, help="also write the result as JSON here")
  ap.add_argument("--write", default=None, help=argparse.SUPPRESS)   # the folder-writing child
  args = ap.parse_args()
  if args.write:
    sizes = write_mixtral(Path(args.write), args.layers, args.d_model, args.ffn, args.experts,
                          args.vocab)
    (Path(args.write) / "sizes.json").write_text(json.dumps(sizes))
    return

  work = Path(args.workdir or tempfile.mkdtemp(prefix="import_peak_rss_"))
  try:
    t = time.time()
    # Written by a child: this process stays small, since a fork's child starts with (and
    # ru_maxrss counts) the parent's resident pages.
    subprocess.run([sys.executable, __file__, "--write", str(work / "hf"), *sys.argv[1:]],
                   check=True)
    sizes = json.loads((work / "hf" / "sizes.json").read_text())
    print(f"wrote {sum(sizes.values()) / MiB:.0f} MiB of safetensors in {time.time() - t:.0f} s",
          file=sys.stderr)
    scale = 2 if args.dtype == "float32" else 1   # the source is bf16
    layer_bytes = {}
    for name, n in sizes.items():
      key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name
      layer_bytes[key] = layer_bytes.get(key, 0) + n * scale
    base, _ = peak_rss([sys.executable, "-c", _BASELINE])
    peak, secs = peak_rss([sys.executable, "-c", _IMPORT, "import", str(work / "hf"),
                           str(work / "run"), "--dtype", args.dtype])
    on_disk = sum(f.stat().st_size for f in (work / "run" / "checkpoints").rglob("*")
                  if f.is_file())
    result = {"params_bytes": sum(sizes.values()) * scale,
              "largest_tensor_bytes": max(sizes.values()) * scale,
              "largest_layer_bytes": max(layer_bytes.values()),
              "checkpoint_bytes_on_disk": on_disk, "tensors": len(sizes),
              "baseline_peak_rss": base, "import_peak_rss": peak, "import_seconds": round(secs, 1),
              "dtype": args.dtype}
    result["import_minus_baseline"] = peak - base
    result["excess_over_model"] = round((peak - base) / result["params_bytes"], 3)
    print(json.dumps(result, indent=2))
    print(f"model {result['params_bytes'] / MiB:.0f} MiB (largest tensor "
          f"{result['largest_tensor_bytes'] / MiB:.1f} MiB, largest layer "
          f"{result['largest_layer_bytes'] / MiB:.0f} MiB); peak RSS: baseline "
          f"{base / MiB:.0f} MiB, import {peak / MiB:.0f} MiB (+{(peak - base) / MiB:.0f} MiB "
          f"= {result['excess_over_model']:.2f} x model) in {secs:.0f} s", file=sys.stderr)
    if args.out:
      Path(args.out).write_text(json.dumps(result, indent=2))
  finally:
    if not args.keep:
      shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
  main()
