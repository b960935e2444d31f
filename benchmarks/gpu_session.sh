#!/usr/bin/env bash
# One call on the GPU machine: named stages, run in order from the repo root (wheels carried in .whl).
#
#   benchmarks/gpu_session.sh STAGE[:LIMIT_S] [STAGE[:LIMIT_S] ...]
#
# Stages (each one's output goes to $OUT/<stage>.log; every figure lands in benchmarks/results/$RUN/):
#   cuda-tests        pytest -m cuda over $CUDA_TESTS (default: the whole suite, tests/; every GPU session starts
#                     with it; its log is committed); with $CUDA_WORKERS=N (pytest-xdist in .whl), N workers share
#                     the GPU, then the tests marked `exclusive` (copy-bandwidth targets) run alone
#   check             every scenario in smoke mode on the GPU (shakes out CUDA-only bugs in seconds)
#   bench-NAME        `python -m fastsft_lab bench --full --only NAME` (packed, offload, moe, combined);
#                     extra flags from $BENCH_NAME (e.g. BENCH_moe="--set moe.tokens=8192")
#   bench-NAME@TAG    the same into bench-NAME-TAG, flags from $BENCH_NAME_TAG (a second configuration in one call)
#   experts-profile   benchmarks/experts_profile.py (one MoE layer's experts vs the grouped matmuls, profiled);
#                     extra flags from $EXPERTS_ARGS
#   notebooks         execute the notebooks ($NOTEBOOKS, default all) with SMOKE=0 into place
#   diagnose          benchmarks/diagnose_report.py: fastsft_lab.diagnose on stock GPT-OSS-20B and the README recipe
#                     (flags from $DIAGNOSE_ARGS, e.g. --only recipe-qwen3)
#   soak              benchmarks/soak.py (long all-fast run: memory slopes, forced OOM fallback, loss curves)
#   plan-script       benchmarks/plan_script.py once per order in $PLAN_SCRIPT_ORDERS (default: build-then-plan
#                     recipe-then-plan), each a fresh process; extra flags from $PLAN_SCRIPT_ARGS
#   unsloth           benchmarks/unsloth_peer.sh: benchmarks/unsloth_peer/ in its own site folder (.whl-unsloth)
#
# RUN names the results folder (default h200-<UTC date>). Everything comes back as one tarball, $OUT/session.tgz
# (the device returns at most a few files): benchmarks/results/$RUN and the executed notebooks, rewritten after every
# stage so that a call cut short at its limit still returns what the finished stages measured.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RUN=${RUN:-h200-$(date -u +%Y-%m-%d)}; export RUN   # run_notebooks.py names it in each notebook's first cell
R=benchmarks/results/$RUN
mkdir -p "$R/logs"
if [ -d .whl ]; then
  # our wheels (bitsandbytes, trl, datasets, liger-kernel) and, for the notebooks stage, a Jupyter kernel (.nbwhl);
  # installed once per machine (a second session started beside a running one must not rewrite its site folder)
  [ -f /tmp/site/.installed ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    $( [ -d .nbwhl ] && ls .nbwhl/*.whl ) || exit 3
  touch /tmp/site/.installed
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/nvidia-smi.csv" 2>&1
python3 -m fastsft_lab info > "$R/info.txt" 2>&1

run_stage() {
  local stage=${1%%:*} limit=${1#*:}
  [ "$limit" = "$1" ] && limit=590
  local log="$R/logs/$stage.log"
  echo "=== $stage (limit ${limit}s) $(date -u +%H:%M:%S)" | tee -a "$OUT/session.log"
  case "$stage" in
    cuda-tests)
      if [ -n "${CUDA_WORKERS:-}" ]; then
        timeout "$limit" bash -c "python3 -m pytest -q -m 'cuda and not exclusive' -n $CUDA_WORKERS ${CUDA_TESTS:-tests} \
          -p no:cacheprovider --no-header -rfEs --durations=15; echo '--- exclusive tests, alone'; \
          python3 -m pytest -q -m 'cuda and exclusive' ${CUDA_TESTS:-tests} -p no:cacheprovider --no-header -rfEs" \
          2>&1 | grep -v '^\s*$' > "$log"
      else
        timeout "$limit" python3 -m pytest -q -m cuda ${CUDA_TESTS:-tests} -p no:cacheprovider --no-header -rfEs \
          --durations=15 2>&1 | grep -v '^\s*$' > "$log"
      fi ;;
    check)
      MPLBACKEND=Agg timeout "$limit" python3 -m fastsft_lab bench --smoke --device cuda --out "$R/check" --quiet \
        > "$log" 2>&1 ;;
    bench-*)
      local spec=${stage#bench-}
      local name=${spec%%@*} tag=${spec#*@}
      [ "$tag" = "$spec" ] && tag=""
      local dir="bench-$name${tag:+-$tag}" var="BENCH_${name}${tag:+_$tag}"
      log="$R/logs/$dir.log"
      MPLBACKEND=Agg FASTSFT_TRACEBACK=1 timeout -s INT "$limit" python3 -m fastsft_lab bench --full --only "$name" \
        --out "$R/$dir" --quiet ${!var:-} > "$log" 2>&1 ;;
    experts-profile)
      timeout -s INT "$limit" python3 benchmarks/experts_profile.py --out "$R/experts-profile" ${EXPERTS_ARGS:-} \
        > "$log" 2>&1 ;;
    notebooks)
      SMOKE=0 MPLBACKEND=Agg timeout "$limit" python3 benchmarks/run_notebooks.py ${NOTEBOOKS:-notebooks/0*.ipynb} \
        > "$log" 2>&1 ;;
    notebooks@*)
      # the notebooks under an emulated smaller GPU (FASTSFT_DEVICE_PROFILE=t4|24gb), executed as copies in the
      # results folder: the committed notebooks stay as the full-size run left them
      local prof=${stage#notebooks@} dir="$R/notebooks-${stage#notebooks@}"
      mkdir -p "$dir" && cp ${NOTEBOOKS:-notebooks/0*.ipynb} "$dir/"
      FASTSFT_DEVICE_PROFILE="$prof" SMOKE=0 MPLBACKEND=Agg timeout "$limit" python3 benchmarks/run_notebooks.py \
        "$dir"/0*.ipynb > "$log" 2>&1 ;;
    diagnose)
      timeout -s INT "$limit" python3 benchmarks/diagnose_report.py --out "$R/diagnose" ${DIAGNOSE_ARGS:-} > "$log" 2>&1 ;;
    soak)
      timeout -s INT "$limit" python3 benchmarks/soak.py --out "$R/soak" ${SOAK_ARGS:-} > "$log" 2>&1 ;;
    plan-script)
      timeout -s INT "$limit" bash -c "for o in ${PLAN_SCRIPT_ORDERS:-build-then-plan recipe-then-plan}; do \
        python3 benchmarks/plan_script.py --order \$o --out $R/plan-script ${PLAN_SCRIPT_ARGS:-} || exit 1; done" \
        > "$log" 2>&1 ;;
    unsloth)
      # one log per peer model and checkpointing setting (several in one call)
      log="$R/logs/unsloth-${UNSLOTH_PEER_MODEL:-qwen3-14b}${UNSLOTH_PEER_CHECKPOINTING:+-ck$UNSLOTH_PEER_CHECKPOINTING}.log"
      timeout -s INT "$limit" bash benchmarks/unsloth_peer.sh "$R/unsloth" > "$log" 2>&1 ;;
    *)
      echo "unknown stage $stage" | tee -a "$log"; return 2 ;;
  esac
  local rc=$?
  echo "    $stage exit $rc $(date -u +%H:%M:%S)" | tee -a "$OUT/session.log"
  tail -25 "$log" >> "$OUT/session.log"
  cp "$OUT/session.log" "$R/logs/session.log"
  tar czf "$OUT/session.tgz" "$R" notebooks/*.ipynb
}

for s in "$@"; do run_stage "$s"; done
ls -la "$OUT"
