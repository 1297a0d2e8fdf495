#!/usr/bin/env bash
# GPU verification in stages, each with its own time limit, logs written as it goes (so a stage
# cut short still leaves its output). Run from the repo root with cudnn-frontend importable:
#   bash benchmarks/gpu_verify.sh OUT_DIR STAGE...
# Stages: tests-parallel tests-core tests-ada tests-store tests-rows tests-dist dist-steps dist-steps-dit
#         notebooks notebooks-store host api autotune bench-ln bench-rms sweep sweep-bare sweep-fp32-weights sweep-axes ada rows
#         real-diffusers real-transformers
#         diffusers-all
# sweep: cudnorm bench --sweep (default grid: widths x rows, cudnorm/cudnn/kernel/torch/torch-again, and the prior
#   OUT/sweep/prior.json to copy into cudnorm/priors/); its plans go to a store of its own. With SWEEP_AGAINST=an
#   earlier sweep.csv, the two compared cell by cell (cudnorm bench --from-csv ... --against) into OUT/sweep/against.txt.
#   sweep-bare, sweep-fp32-weights: the same cells without weights, and with fp32 weights (one call each).
#   sweep-axes: what the default grid holds fixed (2^21 elements, fp32 weights, fp16 and fp32 input) on the cliffs,
#   narrow and model widths (cudnorm bench --sweep axes, one call).
# Plan stores go under STORES (default $TMPDIR/cudnorm-stores, a folder per OUT), not OUT.
# tests-parallel: every gpu-marked test but the 2-GPU ones, split over PARALLEL (default 6) pytest
# processes sharing the GPU (graph builds are CPU-bound: one process takes more than 10 minutes);
# the tests marked `alone` run after them, in one process (ALONE_LIMIT s, default LIMIT's). TESTS_SHARD=i/n: only every n-th test
# from the i-th (from 0), to spread the suite over n GPUs, one invocation per GPU with its own
# OUT and CUDA_VISIBLE_DEVICES (the `alone` tests in shard 0); a 230 s LIMIT cut the whole suite
# on one GPU to 719 of its tests (4-GPU H200, beside 3 other jobs).
# notebooks: needs the dev extra's nbformat, nbclient and ipykernel importable (else every notebook test fails, saying so).
# notebooks-store: executes every notebook on this GPU and writes them with their outputs to OUT/notebooks/; copy
#   them into notebooks/ and commit (tools/make_notebooks.py --check then accepts them until a source changes).
# dist-steps: NPROC ranks (default 2, one GPU each; NPROC=1 runs the same script on one GPU).
# dist-steps-dit: diffusers' DiT-XL/2 at full depth (28 blocks, B 32 per rank, 256 px) under FSDP2 over NPROC ranks
#   (default 4), rows appended to OUT/distributed_steps.csv beside dist-steps'.
# real-diffusers: the four diffusers models patched by default, with blocks=True and under policy="torch" (the
#   control for cudnorm's own Python), beside PyTorch again and the limit; real-transformers: Llama/Qwen3 widths.
# diffusers-all: every transformer class diffusers exports, default config, 1 layer per kind (_bench/real_models/
#   diffusers_all.py), train and sample; diffusers from benchmarks/diffusers_wheels.sh (the image has none).
#   models.csv is written after every case: a stage cut at its limit still leaves the cases it ran.
#   DA_FILTER: the classes to run (comma-separated class names or substrings of case ids, each taken as
#   diffusers-all:<item>; default every class), e.g. SanaTransformer2DModel,FluxTransformer2DModel:train, or the classes
#   whose blocks blocks=True fuses with DA_PROVIDERS=torch,cudnorm,cudnorm-blocks,torch-again (default
#   torch,cudnorm,torch-again).
#   DIFFUSERS_SITE: a --target folder holding those wheels, put on PYTHONPATH for the diffusers stages alone (its
#   pins, e.g. huggingface_hub < 2, then shadow nothing the other stages import).
# lookup: the host cost of the dispatcher's decision lookup on the native path (benchmarks/decision_lookup.py).
# --spread (first argument): on a machine of several GPUs, each stage on a GPU of its own, at once, into
#   OUT/<stage>/ (stages of one GPU each: not tests-dist or the dist-steps); its log is OUT/<stage>.log;
#   a+b runs stages a then b on one GPU (into OUT/a_b/).
set -uo pipefail
if [ "${1:-}" = "--spread" ]; then
  shift; out=${1:?output directory}; shift
  mkdir -p "$out"; gpu=0
  for stages in "$@"; do
    name=${stages//+/_}
    CUDA_VISIBLE_DEVICES=$gpu bash "$0" "$out/$name" ${stages//+/ } > "$out/$name.log" 2>&1 &
    gpu=$((gpu + 1))
  done
  wait
  for stages in "$@"; do echo "==== $stages"; tail -n "${SPREAD_TAIL:-30}" "$out/${stages//+/_}.log"; done
  exit 0
fi
out=${1:?output directory}; shift
mkdir -p "$out"
# plan stores (hundreds of files) live outside OUT, emptied at the start as a fresh OUT would
# be: a lent machine sends back a limited number of files, and one run's store crowded out the
# models.csv beside it
stores="${STORES:-${TMPDIR:-/tmp}/cudnorm-stores}/$(realpath -m "$out" | tr / _)"
rm -rf "$stores"; mkdir -p "$stores"
export PYTHONUNBUFFERED=1 CUDNORM_PLAN_STORE_DIR="$stores/plan-store"
# a test running longer than this prints every thread's stack into its part's log (pytest's
# faulthandler_timeout): a part cut by its limit then says where it was
STUCK_S=${STUCK_S:-60}
pytest_gpu() {  # name, limit, files...: failures are reported inline (-rfE) and as XML
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --tb=short -o faulthandler_timeout="$STUCK_S" \
    --junitxml="$out/$name.xml" "$@" 2>&1 | grep --line-buffered -vE "nanobind|leaked|skipped remainder" | tee "$out/$name.log" | tail -25
}
for stage in "$@"; do
  echo "== $stage"
  case $stage in
    tests-parallel)
      python3 -m pytest -q --collect-only -m "gpu and not alone" -p no:cacheprovider tests 2>/dev/null | grep "::" \
        | grep -v test_distributed > "$out/gpu_ids.txt"
      if [ -n "${TESTS_SHARD:-}" ]; then  # i/n: every n-th test from the i-th (one GPU each with --spread)
        awk -v s="${TESTS_SHARD%/*}" -v n="${TESTS_SHARD#*/}" '(NR - 1) % n == s' "$out/gpu_ids.txt" > "$out/shard_ids.txt"
        mv "$out/shard_ids.txt" "$out/gpu_ids.txt"
      fi
      n=${PARALLEL:-6}
      for i in $(seq 0 $((n - 1))); do
        awk -v n="$n" -v i="$i" 'NR % n == i' "$out/gpu_ids.txt" > "$out/ids_$i"
        mapfile -t ids < "$out/ids_$i"
        CUDNORM_PLAN_STORE_DIR="$stores/plan-store-$i" timeout "${LIMIT:-420}" python3 -m pytest -q -p no:cacheprovider \
          -o faulthandler_timeout="$STUCK_S" \
          -rfEs --tb=short --junitxml="$out/part$i.xml" "${ids[@]}" > "$out/part$i.log" 2>&1 &
      done
      wait
      # tests marked `alone` measure the whole GPU's memory: after the parts, with the GPU to themselves
      # (in the first shard only)
      shard=${TESTS_SHARD:-0/1}
      if [ "$shard" = "0/${shard#*/}" ]; then
        CUDNORM_PLAN_STORE_DIR="$stores/plan-store-alone" timeout "${ALONE_LIMIT:-${LIMIT:-420}}" python3 -m pytest -q -p no:cacheprovider \
          -o faulthandler_timeout="$STUCK_S" \
          -m "gpu and alone" -rfEs --tb=short --junitxml="$out/part-alone.xml" tests > "$out/part-alone.log" 2>&1
      fi
      tail -qn1 "$out"/part*.log; grep -h "^FAILED\|^ERROR" "$out"/part*.log
      # per-test outcomes of every part in one file (the XMLs are many files; few come back)
      python3 - "$out" <<'PY' > "$out/outcomes.txt"
import glob, sys, xml.etree.ElementTree as ET
for path in sorted(glob.glob(f"{sys.argv[1]}/part*.xml")):
    for case in ET.parse(path).iter("testcase"):
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        print(kind, f"{case.get('classname')}::{case.get('name')}")
PY
      cut -d' ' -f1 "$out/outcomes.txt" | sort | uniq -c ;;
    tests-dist)  pytest_gpu tests-dist 300 tests/test_distributed.py ;;
    dist-steps)
      for setup in fsdp2 tp; do
        timeout 240 torchrun --standalone --nproc-per-node "${NPROC:-2}" benchmarks/distributed_steps.py --setup "$setup" \
          --out "$out/distributed_steps.csv" 2>&1 | grep -vE "nanobind|leaked|OMP_NUM_THREADS|^\*+$" | tail -6
      done ;;
    dist-steps-dit)
      timeout 420 torchrun --standalone --nproc-per-node "${NPROC:-4}" benchmarks/distributed_steps.py --model dit \
        --out "$out/distributed_steps.csv" 2>&1 | grep -vE "nanobind|leaked|OMP_NUM_THREADS|^\*+$" | tail -8 ;;
    tests-core)  pytest_gpu tests-core 200 tests/test_norms_gpu.py tests/test_bench.py ;;
    tests-ada)   pytest_gpu tests-ada 150 tests/test_ada_layer_norm.py ;;
    tests-store) pytest_gpu tests-store 200 tests/test_plan_store_gpu.py ;;
    tests-rows)  pytest_gpu tests-rows 120 tests/test_rows.py ;;
    notebooks)   timeout 480 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_notebooks.py 2>&1 | tee "$out/notebooks.log" | tail -15 ;;
    notebooks-store) timeout 540 python3 tools/make_notebooks.py --execute --into "$out/notebooks" 2>&1 \
                   | grep -v "running over TCP" | tee "$out/notebooks-store.log" | tail -10 ;;
    host)        timeout 150 python3 benchmarks/host_profile.py --out "$out" 2>&1 | tee "$out/host.log" | grep -E " us$|device" ;;
    api)         timeout 200 python3 benchmarks/api_vs_raw.py --out "$out" --parts api,host 2>&1 | tee "$out/api.log" | grep -E "test=|device" ;;
    autotune)    timeout 300 python3 benchmarks/autotune_agreement.py --processes 2 layer_norm:bwd:4096x3072 layer_norm:bwd:4096x1152 rms_norm:train:32768x16384 layer_norm:train:32768x1024 2>&1 | tee "$out/autotune.log" | tail -20 ;;
    bench-ln)    timeout 300 python3 -m cudnorm.cli bench --ops ln_fwd,ln_bwd --out "$out/bench-ln" 2>&1 | tail -30 ;;
    bench-rms)   timeout 240 python3 -m cudnorm.cli bench --ops rms_fwd,rms_bwd --out "$out/bench-rms" 2>&1 | tail -30 ;;
    sweep|sweep-bare|sweep-fp32-weights|sweep-axes)  # the default grid, or a variant (cudnorm bench --sweep bare, ...)
                 kind=default; [ "$stage" = sweep ] || kind=${stage#sweep-}
                 CUDNORM_PLAN_STORE_DIR="$stores/$stage-plan-store" timeout "${SWEEP_LIMIT:-560}" python3 -m cudnorm.cli bench \
                   --sweep "$kind" --providers torch,cudnorm,cudnn,kernel,copy,torch-again --out "$out/$stage" 2>&1 | tail -40
                 # SWEEP_AGAINST=an earlier sweep.csv of the same grid: the two cell by cell, into OUT/<stage>/against.txt
                 if [ -n "${SWEEP_AGAINST:-}" ] && [ -f "$out/$stage/sweep.csv" ]; then
                   python3 -m cudnorm.cli bench --from-csv "$out/$stage/sweep.csv" --against "$SWEEP_AGAINST" \
                     > "$out/$stage/against.txt" 2>&1; head -20 "$out/$stage/against.txt"
                 fi ;;
    lookup)      timeout 120 python3 benchmarks/decision_lookup.py --out "$out" 2>&1 | tee "$out/lookup.log" | tail -8 ;;
    ada)         timeout 150 python3 benchmarks/ada_backward_strategies.py --out "$out" 2>&1 | tee "$out/ada.log" | tail -12 ;;
    rows)        timeout 420 python3 benchmarks/variable_rows.py --passes 1 --csv "$out/variable_rows.csv" 2>&1 | tee "$out/rows.log" | grep -vE "nanobind|leaked" | tail -12 ;;
    real-diffusers) PYTHONPATH=${DIFFUSERS_SITE:+$DIFFUSERS_SITE:}${PYTHONPATH:-} timeout "${MODELS_LIMIT:-560}" python3 -m cudnorm.cli bench --models diffusers- --out "$out/real-diffusers" \
                      --providers "${REAL_PROVIDERS:-torch,cudnorm,cudnorm-blocks,cudnorm-torch,torch-again,limit}" 2>&1 | tail -40 ;;
    diffusers-all)  # resumed while a case kills the process (a CUDA error ends it), within MODELS_LIMIT in all;
      # DA_SHARD=i/n: the i-th (from 0) of n equal slices of the classes, by name (one GPU each with --spread)
      end=$(( $(date +%s) + ${MODELS_LIMIT:-560} ))
      filter=diffusers-all
      [ -n "${DA_FILTER:-}" ] && filter=$(echo "$DA_FILTER" | sed -E 's/(^|,)(diffusers-all:)?/\1diffusers-all:/g')
      if [ -n "${DA_SHARD:-}" ]; then
        filter=$(PYTHONPATH=${DIFFUSERS_SITE:+$DIFFUSERS_SITE:}${PYTHONPATH:-} python3 -c "
import sys; from cudnorm._bench.real_models import diffusers_all as d
i, n = map(int, sys.argv[1].split('/')); names = d.names()
print(','.join(f'{m}:' for m in names[i * len(names) // n:(i + 1) * len(names) // n]))" "$DA_SHARD" 2>/dev/null)
      fi
      while :; do
        PYTHONPATH=${DIFFUSERS_SITE:+$DIFFUSERS_SITE:}${PYTHONPATH:-} timeout $(( end - $(date +%s) )) python3 -m cudnorm.cli \
          bench --models "$filter" --resume --out "$out/diffusers-all" --providers "${DA_PROVIDERS:-torch,cudnorm,torch-again}" 2>&1 | tail -80
        [ -f "$out/diffusers-all/running.txt" ] && [ $(( end - $(date +%s) )) -gt 30 ] || break
        echo "resuming after: $(cat "$out/diffusers-all/running.txt")"
      done ;;
    real-transformers) timeout 400 python3 -m cudnorm.cli bench --models transformers- --out "$out/real-transformers" \
                      --providers torch,cudnorm,cudnorm-torch,torch-again,limit,liger 2>&1 | tail -20 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
