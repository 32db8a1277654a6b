#!/usr/bin/env bash
# One device call for the quantized decode kernel: the bench table (copy ceiling in the
# same run; --barriers adds the Mosaic kernel with explicit + merged barriers, mosaic_xm,
# checked against the reference at <= 32k), then the compiled kernel with both options against
# the reference on every bit width, axis order and 1/4/8 query heads per kv-head
# (check_decode_gpu.py), then, with a correctness check first, explicit_barriers x
# merged_barriers (warp_mma's warpgroup barriers: Pallas' own ones dropped, one per
# half-tile), twice, alternating, then optionally an on-device trace of the default. Each step has its own
# time limit, so a slow one cannot eat the others; logs go to $OUT (bench.txt,
# bench_decode_attention.json, check.txt, prof.txt).
# Usage (device machine, repo root):
#   bash experiments/decode_device_round.sh [BENCH_S] [PROF_S] [TRACE_S] [CHECK_S]
# (seconds for the bench, the profile step, the trace and the layout check (0: none);
# defaults 270, 140, 50, 90: 550 s, inside one 600 s call)
set -u
BENCH_S=${1:-270}
PROF_S=${2:-140}
TRACE_S=${3:-50}
CHECK_S=${4:-90}
OUT=${OUT:-runs/decode_device_round}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1   # a step killed at its limit keeps its log
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__)"

timeout "$BENCH_S" python3 experiments/bench_decode_attention.py --barriers \
  --deadline $((BENCH_S * 3 / 4)) --out "$OUT" > "$OUT/bench.txt" 2>&1
echo "bench rc $?"
grep -a "device copy" "$OUT/bench.txt"
tail -25 "$OUT/bench.txt"

if [ "$CHECK_S" -gt 0 ]; then
  timeout "$CHECK_S" python3 experiments/check_decode_gpu.py --mosaic --explicit-barriers \
    --merged-barriers --quick --ratios=1,4,8 > "$OUT/check.txt" 2>&1
  echo "layout check (explicit + merged barriers) rc $?"
  grep -a "FAIL\|worst\|Error" "$OUT/check.txt" | head -20
fi

timeout "$PROF_S" python3 experiments/profile_decode_mgpu.py --check --explicit 0 1 0 1 \
  --merged 0 1 > "$OUT/prof.txt" 2>&1
echo "profile (explicit_barriers x merged_barriers) rc $?"
if [ "$TRACE_S" -gt 0 ]; then
  timeout "$TRACE_S" python3 experiments/profile_decode_mgpu.py --trace /tmp/decode_trace \
    >> "$OUT/prof.txt" 2>&1
  echo "trace rc $?"
fi
grep -a "check\|B=\|trace\|kcycles\|Error" "$OUT/prof.txt" | sed -E "s/inflight=.*wm=/wm=/" | cut -c1-220
