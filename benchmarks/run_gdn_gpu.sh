#!/usr/bin/env bash
# Issue 42's Gated DeltaNet measurements in one GPU run that ends within BUDGET_S seconds (default 230):
#   1. bench_gdn_decode.py: the GDN decode layer (Qwen3.5-9B geometry) at batch 1 8 64 256 512, ours vs fla's
#      fused_recurrent_gated_delta_rule vs the ReplaySSM-GDN read and flush, CUDA graphs    (~40 s expected)
#   2. bench_gdn_prefill.py: one Qwen3.5-9B GDN layer's prefill of 16 x 1024 tokens through chunk_gated_delta
#      (fla): tokens/s and MFU; fla autotunes its chunk kernels on the first call           (~40-70 s expected)
#   3. bench_e2e.py --size qwen3.5-9b: decode end to end at batch 1 and 256, the baseline backend, and a row
#      for ReplaySSM ('refused' until the engine serves GDN layers with it)                  (~60-90 s expected)
# Each step runs under `timeout`, capped by what is left of the budget, so a slow step costs only itself;
# bench_e2e saves its JSON after every row. Optional, with what time is left (both left out by default):
#   GDN_E2E_PREFILL=1  bench_e2e's whole-model prefill of 16 x 1024 (MFU); minutes while the baseline GDN
#                      backend runs the token-by-token reference, seconds once it runs chunk_gated_delta
#   GDN_E2E_35B=1      bench_e2e --size qwen3.5-35b-a3b at batch 1 (70 GB of bf16 weights: H100 just fits)
# Usage, from anywhere (runs from the repository root):
#   bash benchmarks/run_gdn_gpu.sh
#   OUT=dir        logs and JSON go here (default runs/gdn-gpu): run.log, gdn_decode.json, gdn_prefill.json,
#                  e2e/bench_e2e.json (+ .png with matplotlib), e2e_prefill/, e2e_35b/ when asked for
#   FLA_SITE=dir   a folder holding the packages fla (fla-core 0.6.0) and einops, put on PYTHONPATH when fla
#                  is not importable (default wheels/fla_site: /wheels/ is git-ignored, so carry it)
#   PYTHON=python3 the interpreter (the GPU machine's python3 holds torch and triton)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gdn-gpu}
mkdir -p "$OUT"
LOG="$OUT/run.log"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
FLA_SITE=${FLA_SITE:-wheels/fla_site}
if ! "$PY" -c "import fla.ops.gated_delta_rule" 2>/dev/null && [ -d "$FLA_SITE" ]; then
    export PYTHONPATH="$PYTHONPATH:$(cd "$FLA_SITE" && pwd)"
fi
"$PY" -c "import fla.ops.gated_delta_rule" >/dev/null 2>&1 && fla="fla importable" || fla="fla NOT importable"
deadline=$(( $(date +%s) + ${BUDGET_S:-230} ))
echo "== $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'); $fla; budget ${BUDGET_S:-230} s" \
    | tee "$LOG"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
          torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')" 2>&1 | tee -a "$LOG"

# step NAME LIMIT_S COMMAND...: COMMAND under timeout, at most LIMIT_S and what is left of the budget.
step() {
    local name=$1 limit=$2 left start rc
    shift 2
    left=$(( deadline - $(date +%s) ))
    (( left < limit )) && limit=$left
    if (( limit < 10 )); then
        echo "== $name: skipped, ${left} s of the budget left" | tee -a "$LOG"
        return
    fi
    echo "== $name (timeout ${limit} s): $*" | tee -a "$LOG"
    start=$(date +%s)
    timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc$( (( rc == 124 || rc == 137 )) && echo ' (timed out)') after $(( $(date +%s) - start )) s" \
        | tee -a "$LOG"
}

step gdn_decode 80 "$PY" benchmarks/bench_gdn_decode.py --graph --batch 1 8 64 256 512 --out "$OUT/gdn_decode.json"
step gdn_prefill 90 "$PY" benchmarks/bench_gdn_prefill.py --size qwen3.5-9b --prompts 16 --len 1024 \
    --out "$OUT/gdn_prefill.json"
# 4-token prompts: the baseline GDN backend prefills token by token in the reference ops (seconds at batch 256).
step e2e_qwen3.5-9b 120 "$PY" benchmarks/bench_e2e.py --device cuda --size qwen3.5-9b --batch 1 256 \
    --backends baseline replay --prompt-len 4 --steps 32 --repeats 3 --profile-steps 8 --skip-prefill --out "$OUT/e2e"
if [ "${GDN_E2E_PREFILL:-0}" = 1 ]; then
    step e2e_prefill_qwen3.5-9b 600 "$PY" benchmarks/bench_e2e.py --device cuda --size qwen3.5-9b --skip-decode \
        --backends baseline --prefill-prompts 16 --prefill-len 1024 --ttft-len 1024 --repeats 1 --out "$OUT/e2e_prefill"
fi
if [ "${GDN_E2E_35B:-0}" = 1 ]; then
    step e2e_qwen3.5-35b-a3b 600 "$PY" benchmarks/bench_e2e.py --device cuda --size qwen3.5-35b-a3b --batch 1 \
        --backends baseline --prompt-len 4 --steps 32 --repeats 2 --profile-steps 0 --skip-prefill --out "$OUT/e2e_35b"
fi
echo "== done after $(( $(date +%s) - deadline + ${BUDGET_S:-230} )) s; outputs in $OUT" | tee -a "$LOG"
