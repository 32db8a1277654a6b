"""Hash the Mosaic GPU module of the quantized decode kernel over many layouts and options.

A refactor that should not change the kernel must leave every hash as it was. No GPU
needed (lowered for CUDA on a CPU machine; ~2.5 min on 2 cores):
  JAX_PLATFORMS=cpu PYTHONPATH=. python experiments/mosaic_module_sweep.py --out /tmp/new.json
  (cd OTHER_TREE && JAX_PLATFORMS=cpu PYTHONPATH=. python .../mosaic_module_sweep.py --out /tmp/old.json)
  python experiments/mosaic_module_sweep.py --compare /tmp/old.json /tmp/new.json
Layouts: 2/3/4/8 bits x 0/2/3 % outlier channels x 4 or 8 query heads per kv-head (B = 2,
2 kv heads, 4k tokens, G = 32). An option set that raises records its error instead.
"""
import argparse
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

OPTION_SETS = [
    {}, {"warp_mma": False}, {"explicit_barriers": True, "merged_barriers": True},
    {"explicit_barriers": True}, {"merged_barriers": True}, {"split_fetch": False},
    {"split_fetch": False, "stages": 2}, {"outliers_in_mma": False}, {"staged_outliers": False},
    {"in_place_codes": False}, {"phase_slots": 2}, {"early_fetch": False},
    {"loop_descriptors": False}, {"heads_pad": 16}, {"warp_mma": False, "phase_slots": 4},
    {"merge_kernel": False}, {"inflight": 0},
]


def sweep():
  import jax
  import jax.numpy as jnp
  from mosaic_module import mosaic_module_text
  from pallas_kernels import decode_attention_mgpu as dm
  from pallas_kernels import kv_quant as kq

  hashes = {}
  for bits in (2, 3, 4, 8):
    for frac in (0.0, 0.02, 0.03):
      for heads in (4, 8):
        cfg = kq.KVQuantConfig(bits=bits, group_size=32, outlier_fraction=frac, residual_window=32)
        kv = jax.eval_shape(lambda cfg=cfg: kq.empty_kv(cfg, 2, 2, 128, 4096))
        q = jax.ShapeDtypeStruct((2, 2 * heads, 128), jnp.bfloat16)
        for kw in OPTION_SETS:
          key = f"bits={bits} outliers={frac} heads={heads} {json.dumps(kw, sort_keys=True)}"
          try:
            text = mosaic_module_text(
                lambda q, kv, kw=kw: dm.decode_attention_mgpu(q, kv, sm_scale=128 ** -0.5, **kw), q, kv)
            hashes[key] = hashlib.sha1(text.encode()).hexdigest()
          except Exception as e:  # noqa: BLE001  (recorded: an error must stay the same error)
            hashes[key] = f"ERR {type(e).__name__}: {str(e)[:200]}"
  return hashes


def differing(old: dict, new: dict) -> list:
  """Combinations whose hash (or recorded error) differs, or that only one sweep has."""
  return sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", help="write the hashes here (JSON)")
  ap.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="report keys whose hash differs")
  a = ap.parse_args()
  if a.compare:
    old, new = (json.load(open(p)) for p in a.compare)
    diff = differing(old, new)
    for k in diff:
      print(f"differs: {k}")
    print(f"{len(old)} / {len(new)} combinations, {len(diff)} differ, "
          f"{len(set(new.values()))} distinct modules")
    return 1 if diff else 0
  hashes = sweep()
  errors = sum(v.startswith("ERR") for v in hashes.values())
  print(f"{len(hashes)} combinations, {errors} errors, {len(set(hashes.values()))} distinct modules")
  if a.out:
    with open(a.out, "w") as f:
      json.dump(hashes, f, indent=0, sort_keys=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
