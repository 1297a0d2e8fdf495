#!/usr/bin/env bash
# The GPU verification run, as executed on the lent H100/H200 (see benchmarks/results/<gpu>/).
# Usage (from the repo root, cudnn-frontend importable): bash benchmarks/gpu_checks.sh OUT_DIR [tests|bench]
set -uo pipefail
out=${1:?output directory}; part=${2:-tests}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 CUDNORM_PLAN_STORE_DIR="$out/plan-store"
if [ "$part" = tests ]; then
  timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$out/gpu_tests.log" | tail -25
  timeout 150 python3 benchmarks/api_vs_raw.py --out "$out" --parts api,host 2>&1 | tee "$out/api_vs_raw.log" | grep -E "test=|device"
else
  timeout 160 python3 benchmarks/ada_backward_strategies.py --out "$out" 2>&1 | tee "$out/ada.log" | tail -12
  timeout 200 python3 benchmarks/variable_rows.py --out "$out" 2>&1 | tee "$out/variable_rows.log" | tail -15
fi
