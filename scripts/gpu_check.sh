#!/usr/bin/env bash
# One prepared GPU check, about 6 minutes on one H200 (5 min 9 s in its first run there, before step 6):
#   1. the CUDA tests (tests/test_cuda.py: no math-kernel SDPA, no host sync in the forward,
#      bf16 default, KV pool from gpu_memory_utilization, measured costs, swap on its own stream; and the
#      sliding windows and penalties against their host references);
#   2. a random-weight model with Llama-3-8B's shapes, built on the GPU in bfloat16;
#   3. decode step time (16 at context 64 vs 15 + one at 2048; and 32 at 1024 vs 31 + one at 7900,
#      which with the bench's 256 new tokens fills Llama-3's 8192)
#      against the memory-bandwidth bound;
#   4. engine throughput against transformers' generate (static batch), token-identical check;
#   5. the seed preemption benchmark on the GPU (preemption event costs);
#   6. where a decode step's time goes (scripts/profile_step.py): host launches against device time,
#      this engine and transformers' own forward, with the cost of one kernel launch on this machine.
# Fails fast, with a clear message, when CUDA is not there. CI never runs it.
# Every step runs even when an earlier one failed (a GPU is lent rarely and briefly: one failure must not
# cost the other figures); the summary at the end lists each step's status, and the exit status is 1 if any failed.
#
#   scripts/gpu_check.sh [OUTPUT_DIR]      (default: gpu-check-output)
#   PY=...         the interpreter (default: .venv/bin/python, else python3)
#   MODEL_DIR=...  where the 16 GB model is written (default: OUTPUT_DIR/llama3-8b-shape)
#   BUDGET_S=...   the whole check's seconds (default: none); each step gets at most what is left, and a step
#                  with under 20 s left is skipped (a lease's time limit kills everything, the summary included)
#   STEPS=...      the steps to run, e.g. "2 3b 6" (default: all; 3 to 6 need the model of step 2)
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PY:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT=${1:-gpu-check-output}
HBM_GBPS=${HBM_GBPS:-4800}  # H200
export TQDM_DISABLE=1  # progress bars would drown the figures in a captured log
mkdir -p "$OUT"
log() { printf '\n=== %s (%ss)\n' "$*" "$SECONDS"; }
SUMMARY=()
FAILED=0
BUDGET_S=${BUDGET_S:-0}
STEPS=${STEPS:-1 2 3a 3b 4 5 6}
# step NAME LIMIT_S CMD...: runs CMD under a timeout, records its status; a step never stops the check.
step() {
    local name=$1 limit=$2; shift 2
    local start=$SECONDS rc
    if [[ " $STEPS " != *" ${name%%.*} "* ]]; then return 0; fi
    if ((BUDGET_S > 0 && BUDGET_S - SECONDS < limit)); then limit=$((BUDGET_S - SECONDS)); fi
    if ((limit < 20)); then
        SUMMARY+=("$(printf '%-48s skipped: the budget is spent' "$name")")
        FAILED=1
        return 0
    fi
    timeout "$limit" "$@"
    rc=$?
    SUMMARY+=("$(printf '%-48s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - start))")")
    if ((rc != 0)); then FAILED=1; fi
    return 0
}

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: CUDA is not available to $PY (torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo '?')); nothing was run." >&2
    exit 2
fi
"$PY" - <<'EOF'
import torch
p = torch.cuda.get_device_properties(0)
print(f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF

log "1. CUDA tests"
step "1. CUDA tests" 180 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_step_syncs.py tests/test_sliding_window.py tests/test_penalties.py

log "2. random Llama-3-8B-shaped model, bf16, built on the GPU"
MODEL=${MODEL_DIR:-$OUT/llama3-8b-shape}
step "2. build the model" 240 "$PY" - "$MODEL" <<'EOF'
import json, sys
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from scripts.make_tiny_model import _NON_MODEL_KEYS, build_tokenizer

out = Path(sys.argv[1])
if not (out / "config.json").exists():
    raw = json.loads(Path("models/configs/gpu-llama3-8b-shape.json").read_text())
    tok = build_tokenizer(raw["vocab_size"])
    fields = {k: v for k, v in raw.items() if k not in _NON_MODEL_KEYS and k != "architectures"}
    config = AutoConfig.for_model(fields.pop("model_type"), bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **fields)
    torch.manual_seed(raw["init_seed"])
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"built {out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters")
EOF

log "3. decode step time against the bandwidth bound (one long sequence among short ones)"
step "3a. decode step, 16 at context 64" 150 "$PY" scripts/bench_decode_step.py --model "$MODEL" --device cuda --dtype bfloat16 \
    --batch 16 --context 64 --long-context 2048 --rounds 3 --steps 10 --hbm-gbps "$HBM_GBPS" \
    --json "$OUT/decode-step-16.json"
step "3b. decode step, 32 at context 1024" 150 "$PY" scripts/bench_decode_step.py --model "$MODEL" --device cuda --dtype bfloat16 \
    --batch 32 --context 1024 --long-context 7900 --rounds 3 --steps 10 --hbm-gbps "$HBM_GBPS" \
    --json "$OUT/decode-step-32.json"

log "4. engine throughput against transformers generate (greedy, token-identical check)"
step "4. engine against generate" 200 "$PY" scripts/bench_engine.py --model "$MODEL" --device cuda --dtype bfloat16 \
    --batch 32 --prompt-tokens 512 --new-tokens 128 --repeats 2 --skip-generate-batch \
    --gpu-memory-utilization 0.4 --json "$OUT/bench-engine.json"

log "5. seed preemption benchmark on the GPU (preemption event costs)"
step "5. seed preemption benchmark" 150 "$PY" scripts/bench_preempt.py --device cuda --dtype bfloat16 \
    --json "$OUT/bench-preempt.json"

log "6. where a decode step's time goes: host launches against device time"
step "6. profile a decode step" 120 "$PY" scripts/profile_step.py --model "$MODEL" --device cuda --dtype bfloat16 \
    --batch 16 --context 64 --hf --json "$OUT/profile-step.json"

log "done; JSON in $OUT"
printf '%s\n' "${SUMMARY[@]}"
exit "$FAILED"
