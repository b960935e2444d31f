#!/usr/bin/env bash
# The Unsloth peer, as one stage of benchmarks/gpu_session.sh (run from the repo root, .whl-unsloth present, our
# site folder on PYTHONPATH):
#
#   bash benchmarks/unsloth_peer.sh RESULTS_DIR
#
# 1. installs .whl-unsloth into its own site folder ($UNSLOTH_SITE, default /tmp/site-unsloth);
# 2. exports the shared inputs in OUR environment (python -m benchmarks.unsloth_peer export ->
#    $UNSLOTH_PEER_EXPORT_DIR);
# 3. runs python -m benchmarks.unsloth_peer run in the UNSLOTH environment (PYTHONPATH=$UNSLOTH_SITE:$PWD, never our
#    site folder), once with the double buffer on and once off, each in its own process under its own timeout;
#    a failing run does not stop the other; each writes
#    RESULTS_DIR/unsloth-<model>-L<layers>-<tokens>-db{on,off}.json (GPT-OSS: ...-<tokens>-<layout>-db{on,off}.json;
#    an error result if it failed, timed out or was never started) and its log beside it;
# 4. prints one summary line per run. Exit status 0 only if both runs produced measurements.
#
# Time: the whole stage keeps within UNSLOTH_PEER_BUDGET seconds (default 560: set it a little below the stage's
# limit). The export gets at most UNSLOTH_PEER_EXPORT_TIMEOUT (default 240) s; the first run 3/5 of what is left
# (it pays the cold compile caches), the second run all that remains. Other settings: UNSLOTH_PEER_MODEL
# (qwen3-14b, or gpt-oss-20b: bf16, attention LoRA, 4096-token rows), UNSLOTH_PEER_LAYERS (8; 24 = all for
# gpt-oss-20b), UNSLOTH_PEER_TOKENS (8192), UNSLOTH_PEER_ROW_TOKENS (= tokens; 4096 for GPT-OSS),
# UNSLOTH_PEER_LAYOUT (padded for GPT-OSS: one right-padded row per sequence, as Unsloth trains it, padding-free
# packing being blocklisted for gpt_oss; packed: the export's rows, its segments attending across a row; Qwen3:
# packed only), UNSLOTH_PEER_STEPS (6 batches = measured steps), UNSLOTH_PEER_WARMUP (2; the padded layout adds
# warmup steps until every batch shape has run once),
# UNSLOTH_PEER_DB ("on off": which double-buffer settings run, in order), UNSLOTH_PEER_CHECKPOINTING (unsloth:
# use_gradient_checkpointing="unsloth", the default; off: False, every activation kept, results named ...-ckoff-db*;
# UNSLOTH_PEER_DB defaults to "on" with it: the double buffer has nothing to do then), UNSLOTH_PEER_MIX (realistic), UNSLOTH_PEER_RANK (16), UNSLOTH_PEER_REUSE=1 (keep a complete earlier export),
# UNSLOTH_PEER_KEEP=1 (keep the exported weights afterwards; default: deleted, they are ~8 GB for Qwen3-14B x8,
# ~39 GiB for GPT-OSS-20B x24), UNSLOTH_PEER_EXPORT_DIR (/tmp/unsloth-peer; for GPT-OSS /dev/shm/unsloth-peer-moe when
# /dev/shm has 48 GiB free, else /tmp/unsloth-peer-moe), UNSLOTH_WHEELS
# (.whl-unsloth), UNSLOTH_PEER_RUN_ARGS (extra `run` flags, e.g. --seq-lengths-device cuda), PYTHON (python3).
set -uo pipefail

R=${1:?usage: bash benchmarks/unsloth_peer.sh RESULTS_DIR}
mkdir -p "$R"
PY=${PYTHON:-python3}
PEER=benchmarks.unsloth_peer   # the package benchmarks/unsloth_peer/, run as `"$PY" -m $PEER` from the repo root
SITE=${UNSLOTH_SITE:-/tmp/site-unsloth}
WHEELS=${UNSLOTH_WHEELS:-.whl-unsloth}
MODEL=${UNSLOTH_PEER_MODEL:-qwen3-14b}
TOKENS=${UNSLOTH_PEER_TOKENS:-8192}
case "$MODEL" in
  gpt-oss-20b) FAMILY=gpt_oss; DEFAULT_LAYERS=24 ;;
  tiny-gpt-oss) FAMILY=gpt_oss; DEFAULT_LAYERS=4 ;;
  *) FAMILY=qwen3; DEFAULT_LAYERS=8 ;;
esac
LAYERS=${UNSLOTH_PEER_LAYERS:-$DEFAULT_LAYERS}
if [ "$FAMILY" = gpt_oss ]; then
  ROW_TOKENS=${UNSLOTH_PEER_ROW_TOKENS:-$(( TOKENS < 4096 ? TOKENS : 4096 ))}
  EXPORT_MAX_DEFAULT=420
  if [ -z "${UNSLOTH_PEER_EXPORT_DIR:-}" ]; then
    shm_free=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}')
    if [ "${shm_free:-0}" -ge $((48 * 1024 * 1024)) ]; then
      UNSLOTH_PEER_EXPORT_DIR=/dev/shm/unsloth-peer-moe   # RAM: the ~39 GiB write and read are memory speed
    else
      UNSLOTH_PEER_EXPORT_DIR=/tmp/unsloth-peer-moe
    fi
  fi
  DEFAULT_LAYOUT=padded
else
  ROW_TOKENS=${UNSLOTH_PEER_ROW_TOKENS:-$TOKENS}
  EXPORT_MAX_DEFAULT=240
  DEFAULT_LAYOUT=packed
fi
LAYOUT=${UNSLOTH_PEER_LAYOUT:-$DEFAULT_LAYOUT}
case "$LAYOUT" in packed|padded) ;; *) echo "UNSLOTH_PEER_LAYOUT must be packed or padded, got: $LAYOUT" >&2; exit 2 ;; esac
if [ "$FAMILY" != gpt_oss ] && [ "$LAYOUT" = padded ]; then
  echo "UNSLOTH_PEER_LAYOUT=padded is for GPT-OSS only (the Qwen3 peer measures Unsloth's own packing)" >&2; exit 2
fi
STEPS=${UNSLOTH_PEER_STEPS:-6}
WARMUP=${UNSLOTH_PEER_WARMUP:-2}
MIX=${UNSLOTH_PEER_MIX:-realistic}
RANK=${UNSLOTH_PEER_RANK:-16}
BUDGET=${UNSLOTH_PEER_BUDGET:-560}
EXPORT_MAX=${UNSLOTH_PEER_EXPORT_TIMEOUT:-$EXPORT_MAX_DEFAULT}
EXPORT_DIR=${UNSLOTH_PEER_EXPORT_DIR:-/tmp/unsloth-peer}
STEM="unsloth-${MODEL}-L${LAYERS}-${TOKENS}"
[ "$FAMILY" = gpt_oss ] && STEM="$STEM-$LAYOUT"
CKPT=${UNSLOTH_PEER_CHECKPOINTING:-unsloth}
case "$CKPT" in
  unsloth) ;;
  off) STEM="$STEM-ckoff" ;;
  *) echo "UNSLOTH_PEER_CHECKPOINTING must be unsloth or off, got '$CKPT'" >&2; exit 2 ;;
esac
# with checkpointing off the double buffer has nothing to reload: one run (named ...-ckoff-dbon) unless asked
if [ "$CKPT" = off ]; then DBS=${UNSLOTH_PEER_DB:-on}; else DBS=${UNSLOTH_PEER_DB:-on off}; fi
case " $DBS " in *" on "*|*" off "*) ;; *) echo "UNSLOTH_PEER_DB must list on and/or off, got: $DBS" >&2; exit 2 ;; esac
OUR_PYTHONPATH=${PYTHONPATH:-$PWD}
START=$SECONDS
INTERRUPTED=0
trap 'INTERRUPTED=1; echo "[unsloth_peer.sh] interrupted: no further runs start" >&2' INT TERM

log() { echo "[unsloth_peer.sh $(date -u +%H:%M:%S) +$((SECONDS - START))s] $*"; }
left() { echo $((BUDGET - (SECONDS - START))); }
out_of() { echo "$R/$STEM-db$1.json"; }

# An error result for run $1 (on|off) with message $2, written with Unsloth's site folder first on the path so the
# env block names its versions (the command imports nothing of it).
fail_run() {
  local db=$1 msg=$2 out E="stage script: writing the error result failed"
  out=$(out_of "$db")
  PYTHONPATH="$SITE:$PWD" "$PY" -m "$PEER" error-json --out "$out" --double-buffer "$db" --checkpointing "$CKPT" \
    --message "$msg" \
    || printf '{"scenario": "peer-unsloth", "env": {}, "config": {}, "error": "%s",
  "variants": [{"name": "unsloth (double buffer %s)", "error": "%s"}]}\n' "$E" "$db" "$E" > "$out"
}

last_line() { [ -f "$1" ] && grep -v '^\s*$' "$1" | tail -1 | cut -c1-300 | tr -d '"\\' || echo "(no log)"; }

finish() {
  local status=0 db
  log "summary ($STEM, $((SECONDS - START)) s):"
  for db in $DBS; do
    PYTHONPATH="$SITE:$PWD" "$PY" -m "$PEER" summary "$(out_of "$db")" || status=1
  done
  if [ "${UNSLOTH_PEER_KEEP:-0}" != "1" ]; then
    rm -f "$EXPORT_DIR"/*.safetensors
  fi
  [ "$INTERRUPTED" = 1 ] && exit 130
  exit $status
}

log "Unsloth peer: $MODEL, $LAYERS layers, $TOKENS tokens in rows of $ROW_TOKENS, layout $LAYOUT, export $EXPORT_DIR, $STEPS steps (+$WARMUP warmup), budget ${BUDGET}s -> $R"
for db in $DBS; do rm -f "$(out_of "$db")"; done

# 1. Unsloth's own site folder
if ! ls "$WHEELS"/*.whl > /dev/null 2>&1; then
  for db in $DBS; do fail_run "$db" "stage script: no $WHEELS/*.whl in $PWD (the Unsloth wheels must travel)"; done
  finish
fi
log "installing $WHEELS into $SITE"
if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl > "$R/unsloth-install.log" 2>&1; then
  msg="stage script: pip install of $WHEELS into $SITE failed: $(last_line "$R/unsloth-install.log")"
  for db in $DBS; do fail_run "$db" "$msg"; done
  finish
fi

# 2. the export, in our environment
if [ "${UNSLOTH_PEER_REUSE:-0}" = "1" ] && [ -f "$EXPORT_DIR/meta.json" ] \
   && grep -q "\"preset\": \"$MODEL\"" "$EXPORT_DIR/meta.json" \
   && grep -q "\"num_layers\": $LAYERS," "$EXPORT_DIR/meta.json" \
   && grep -q "\"row_tokens\": $ROW_TOKENS," "$EXPORT_DIR/meta.json" \
   && ls "$EXPORT_DIR"/*.safetensors > /dev/null 2>&1; then
  log "reusing the export in $EXPORT_DIR"
else
  t=$EXPORT_MAX; [ "$(($(left) - 240))" -lt "$t" ] && t=$(($(left) - 240)); [ "$t" -lt 60 ] && t=60
  log "export (our environment, timeout ${t}s) -> $EXPORT_DIR, log $R/unsloth-export-$MODEL.log"
  PYTHONPATH="$OUR_PYTHONPATH" PYTHONUNBUFFERED=1 timeout --foreground -s INT -k 20 "$t" \
    "$PY" -m "$PEER" export --out "$EXPORT_DIR" --model "$MODEL" --num-layers "$LAYERS" --tokens "$TOKENS" \
    --row-tokens "$ROW_TOKENS" --steps "$STEPS" --mix "$MIX" --lora-rank "$RANK" > "$R/unsloth-export-$MODEL.log" 2>&1
  rc=$?
  if [ "$rc" != 0 ] || [ ! -f "$EXPORT_DIR/meta.json" ]; then
    why=$(last_line "$R/unsloth-export-$MODEL.log")
    [ "$rc" = 124 ] && why="timed out after ${t}s; $why"
    for db in $DBS; do fail_run "$db" "stage script: export failed (exit $rc): $why"; done
    finish
  fi
fi
cp "$EXPORT_DIR/meta.json" "$R/unsloth-export-$MODEL-meta.json" 2>/dev/null

# 3. one Unsloth process per double-buffer setting
runs_left=$(echo $DBS | wc -w)
for db in $DBS; do
  out=$(out_of "$db")
  logf="$R/$STEM-db$db.log"
  if [ "$INTERRUPTED" = 1 ]; then
    fail_run "$db" "stage script: not run: the stage was interrupted before this run started"
    runs_left=$((runs_left - 1)); continue
  fi
  # the first run pays the cold compile caches: 3/5 of what is left; the last run everything that is left
  if [ "$runs_left" -gt 1 ]; then t=$(( ($(left) - 10) * 3 / 5 )); else t=$(( $(left) - 10 )); fi
  if [ "$t" -lt 60 ]; then
    fail_run "$db" "stage script: not run: its share of the $(left)s left of the ${BUDGET}s stage budget is ${t}s, under the 60s a run needs"
    runs_left=$((runs_left - 1)); continue
  fi
  log "run: double buffer $db (Unsloth environment, timeout ${t}s), log $logf"
  env -u PYTHONPATH PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    HF_DATASETS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 UNSLOTH_COMPILE_LOCATION=/tmp/unsloth_compiled_cache \
    TOKENIZERS_PARALLELISM=false UNSLOTH_PEER_TIMEOUT_S="$t" \
    timeout --foreground -s INT -k 30 "$t" "$PY" -m "$PEER" run --dir "$EXPORT_DIR" --out "$out" \
    --double-buffer "$db" --checkpointing "$CKPT" --warmup "$WARMUP" --layout "$LAYOUT" ${UNSLOTH_PEER_RUN_ARGS:-} \
    > "$logf" 2>&1
  rc=$?
  if ! grep -q '"scenario"' "$out" 2>/dev/null; then
    why=$(last_line "$logf")
    case "$rc" in
      124) why="timed out after ${t}s and left no result; $why" ;;
      137) why="killed after the ${t}s timeout (no result); $why" ;;
      *) why="exited $rc without a result; $why" ;;
    esac
    fail_run "$db" "stage script: run (double buffer $db) $why"
  fi
  log "run: double buffer $db exit $rc"
  runs_left=$((runs_left - 1))
done

finish
