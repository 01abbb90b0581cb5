#!/usr/bin/env bash
# One prepared device check for issue 4 (packed executor and Triton indexed attention) on a CUDA machine:
#   1. the kernel and packed-executor tests natively (tests/test_kernels.py incl. the GPU-marked native BF16 dot,
#      tests/test_packed.py with the Triton backend on CUDA), about 1-2 min;
#   2. scripts/gpu_check.py: packed (SDPA, Flex, Triton, Triton + fused scatter) vs sequential in BF16, the
#      FP32-promotion control, the Table 18 analogue with packed-Triton timed beside packed-SDPA, packed vs Replay,
#      and attention-only timings (Table 19 analogue), about 4-6 min on an H200.
# Results go to $OUT (default outputs/gpu_check): env.txt, pytest.log, gpu_check.log and gpu_check.py's CSVs
# (8 files at most). Extra arguments go to gpu_check.py (e.g. --repeats 5, --skip-timing, --model qwen3-8b-random).
#
# The project needs transformers >= 5.24; an older image needs the wheels carried: put them in .whl/ (ignored by git,
# named in the run's carry) and this script installs them into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-outputs/gpu_check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{ nvidia-smi 2>&1 | head -15
  "$PY" - <<'EOF'
import sys
import torch, transformers
print("python", sys.version.split()[0], "| torch", torch.__version__, "| transformers", transformers.__version__)
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton missing")
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
EOF
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

"$PY" - <<'EOF' || { echo "gpu_check: needs CUDA and transformers>=5.24 (carry wheels in .whl/)" | tee -a "$OUT/env.txt"; exit 3; }
import sys, torch, transformers
major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
sys.exit(0 if torch.cuda.is_available() and (major, minor) >= (5, 24) else 1)
EOF

status=0
timeout 300 "$PY" -m pytest -p no:xdist -q -rs -m "not slow" tests/test_kernels.py tests/test_packed.py 2>&1 \
  | tee "$OUT/pytest.log" || status=1
timeout 480 "$PY" scripts/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log" || status=1
echo "gpu_check finished with status $status"
exit $status
