#!/usr/bin/env bash
# One device call for the quantized decode kernel: the bench table (copy ceiling in the
# same run; --barriers adds the Mosaic kernel with explicit + merged barriers, mosaic_xm,
# checked against the reference at <= 32k), then, with a correctness check first, explicit_barriers x merged_barriers
# (warp_mma's warpgroup barriers: Pallas' own ones dropped, one per half-tile), twice,
# alternating, then optionally an on-device trace of the default. Each step has its own
# time limit, so a slow one cannot eat the others; logs go to $OUT (bench.txt,
# bench_decode_attention.json, prof.txt).
# Usage (device machine, repo root): bash experiments/decode_device_round.sh [BENCH_S] [PROF_S] [TRACE_S]
# (seconds for the bench, the profile step and the trace (0: none); defaults 300, 150, 60)
set -u
BENCH_S=${1:-300}
PROF_S=${2:-150}
TRACE_S=${3:-60}
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

timeout "$PROF_S" python3 experiments/profile_decode_mgpu.py --check --explicit 0 1 0 1 \
  --merged 0 1 > "$OUT/prof.txt" 2>&1
echo "profile (explicit_barriers x merged_barriers) rc $?"
if [ "$TRACE_S" -gt 0 ]; then
  timeout "$TRACE_S" python3 experiments/profile_decode_mgpu.py --trace /tmp/decode_trace \
    >> "$OUT/prof.txt" 2>&1
  echo "trace rc $?"
fi
grep -a "check\|B=\|trace\|kcycles\|Error" "$OUT/prof.txt" | sed -E "s/inflight=.*wm=/wm=/" | cut -c1-220
