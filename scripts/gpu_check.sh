#!/usr/bin/env bash
# One prepared GPU check, meant to finish in under 8 minutes on one H200:
#   1. the CUDA tests (tests/test_cuda.py: no math-kernel SDPA, no host sync in the forward,
#      bf16 default, KV pool from gpu_memory_utilization, measured costs, swap on its own stream);
#   2. a random-weight model with Llama-3-8B's shapes, built on the GPU in bfloat16;
#   3. decode step time (16 at context 64 vs 15 + one at 2048; and 32 at 1024 vs 31 + one at 8000)
#      against the memory-bandwidth bound;
#   4. engine throughput against transformers' generate (static batch), token-identical check;
#   5. the seed preemption benchmark on the GPU (preemption event costs).
# Fails fast, with a clear message, when CUDA is not there. CI never runs it.
#
#   scripts/gpu_check.sh [OUTPUT_DIR]      (default: gpu-check-output; PY=... picks the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-gpu-check-output}
HBM_GBPS=${HBM_GBPS:-4800}  # H200
mkdir -p "$OUT"
log() { printf '\n=== %s (%ss)\n' "$*" "$SECONDS"; }

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
timeout 180 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_step_syncs.py

log "2. random Llama-3-8B-shaped model, bf16, built on the GPU"
MODEL="$OUT/llama3-8b-shape"
timeout 240 "$PY" - "$MODEL" <<'EOF'
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
timeout 150 "$PY" scripts/bench_decode_step.py --model "$MODEL" --device cuda --dtype bfloat16 \
    --batch 16 --context 64 --long-context 2048 --rounds 3 --steps 10 --hbm-gbps "$HBM_GBPS" \
    --json "$OUT/decode-step-16.json"
timeout 150 "$PY" scripts/bench_decode_step.py --model "$MODEL" --device cuda --dtype bfloat16 \
    --batch 32 --context 1024 --long-context 8000 --rounds 3 --steps 10 --hbm-gbps "$HBM_GBPS" \
    --json "$OUT/decode-step-32.json"

log "4. engine throughput against transformers generate (greedy, token-identical check)"
timeout 200 "$PY" scripts/bench_engine.py --model "$MODEL" --device cuda --dtype bfloat16 \
    --batch 32 --prompt-tokens 512 --new-tokens 128 --repeats 2 --skip-generate-batch \
    --gpu-memory-utilization 0.4 --json "$OUT/bench-engine.json"

log "5. seed preemption benchmark on the GPU (preemption event costs)"
timeout 150 "$PY" scripts/bench_preempt.py --device cuda --dtype bfloat16 --json "$OUT/bench-preempt.json" \
    || echo "gpu_check: the seed benchmark did not finish within its 150 s share (see above)"

log "done; JSON in $OUT"
