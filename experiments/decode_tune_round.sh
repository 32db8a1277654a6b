#!/usr/bin/env bash
# One device call: the default split count per size (is _TARGET_PROGRAMS right for warp_mma?),
# ablations of the warp_mma kernel at B=8, 32k (where its time goes) and one on-device trace.
# Usage (device machine, repo root): bash experiments/decode_tune_round.sh [STEP_S]
# Logs: $OUT/tune.txt (one line per variant: "B=.. T=.. splits=.. ... ms TB/s").
set -u
STEP_S=${1:-80}
OUT=${OUT:-runs/decode_tune_round}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
P=experiments/profile_decode_mgpu.py
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__)"
{
  timeout "$STEP_S" python3 $P --b 8 --t 32768 --splits 3 4 6 8 4 8
  timeout "$STEP_S" python3 $P --b 1 --t 131072 --splits 16 32 64 32
  timeout "$STEP_S" python3 $P --b 8 --t 131072 --splits 4 8 4
  timeout "$STEP_S" python3 $P --b 1 --t 32768 --splits 16 32 64 32
  timeout "$STEP_S" python3 $P --b 8 --t 4096 --splits 2 4 8 4
  timeout "$STEP_S" python3 $P --b 8 --t 32768 --ablate - raw rawk rawv nometa -
  timeout "$STEP_S" python3 $P --b 8 --t 32768 --trace /tmp/decode_trace
} > "$OUT/tune.txt" 2>&1
grep -a "B=\|trace\|kcycles\|Error" "$OUT/tune.txt" | sed -E "s/inflight=.*ablate=/ablate=/" | cut -c1-200
