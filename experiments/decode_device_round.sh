#!/usr/bin/env bash
# One device call for the quantized decode kernel: the bench table (copy ceiling in the
# same run), the warp_mma / wgmma ratio and interleave_meta on / off under warp_mma, both
# with a correctness check, then a splits x phase sweep of the default path. Each step has
# its own time limit, so a slow one cannot eat the others; logs go to $OUT (bench.txt,
# bench_decode_attention.json, prof.txt).
# Usage (device machine, repo root): bash experiments/decode_device_round.sh [BENCH_S] [PROF_S] [SWEEP_S]
# (seconds for the bench, each profile step and the sweep (0: none); defaults 300, 100, 100)
set -u
BENCH_S=${1:-300}
PROF_S=${2:-100}
SWEEP_S=${3:-100}
OUT=${OUT:-runs/decode_device_round}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1   # a step killed at its limit keeps its log
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__)"

timeout "$BENCH_S" python3 experiments/bench_decode_attention.py --deadline $((BENCH_S * 3 / 4)) \
  --out "$OUT" > "$OUT/bench.txt" 2>&1
echo "bench rc $?"
grep -a "device copy" "$OUT/bench.txt"
tail -25 "$OUT/bench.txt"

timeout "$PROF_S" python3 experiments/profile_decode_mgpu.py --check --warpmma 0 1 0 1 \
  > "$OUT/prof.txt" 2>&1
echo "profile (wgmma vs warp_mma) rc $?"
timeout "$PROF_S" python3 experiments/profile_decode_mgpu.py --check --interleave 0 1 0 1 \
  >> "$OUT/prof.txt" 2>&1
echo "profile (warp_mma, interleave_meta off / on) rc $?"
if [ "$SWEEP_S" -gt 0 ]; then
  timeout "$SWEEP_S" python3 experiments/profile_decode_mgpu.py --splits 4 8 16 --phase 8 4 \
    >> "$OUT/prof.txt" 2>&1
  echo "profile (splits x phase) rc $?"
fi
grep -a "check\|B=" "$OUT/prof.txt" | cut -c1-260
