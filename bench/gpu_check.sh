#!/usr/bin/env bash
# The GPU check: runs as it is on an offline GPU machine (the machine's python3 and torch, this
# repository on PYTHONPATH, no Ray, no model download) and ends within 8 minutes on one H100.
#
#   bash bench/gpu_check.sh --fetch     here, online: the wheels the GPU machine lacks and the built-in
#                                       model's tokenizer into .gpu_carry/ (git-ignored); prints the
#                                       size of what travels (this tree + .gpu_carry) against 64 MiB
#   bash bench/gpu_check.sh --dry-run   anywhere (CI): every command, import and test it needs exists
#   bash bench/gpu_check.sh [OUT_DIR]   on the GPU machine (with .gpu_carry beside it, if fetched):
#                                       1. the gpu-marked tests that need no Ray; the CPU tests of the
#                                          GPU path on a GPU host; 2. bench/gpu_check.py's measurements.
#                                       A compact summary is printed last; OUT_DIR (default
#                                       bench/out/gpu_check) gets gpu_check.json and the logs
#                                       (GPU_CHECK_ARGS=--smoke: the whole script on the CPU, tiny models).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CARRY=.gpu_carry
# What the GPU image lacks (pure Python or small; cp312 manylinux builds), at the versions CI tests.
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0 llguidance==1.9.1 gguf==0.19.0)
GPU_TESTS=(tests/kernels/test_gpu_path.py tests/kernels/test_triton_attention.py tests/kernels/test_fused_experts_triton.py
           tests/kernels/test_recurrent_triton.py tests/kernels/test_fused_triton.py tests/engine/test_async_scheduling.py
           tests/features/test_expert_load.py
           tests/features/test_tensor_parallel.py)
MAX_BYTES=$((64 << 20))

travelling_bytes() {  # this tree as the device tool sends it (tracked and untracked-not-ignored files) + the carry
  local tree carry=0
  tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  [ -d "$CARRY" ] && carry=$(du -sb "$CARRY" | cut -f1)
  echo "$tree $carry"
}

case "${1:-}" in
--fetch)
  rm -rf "$CARRY/wheels" && mkdir -p "$CARRY/wheels"
  platforms=()
  for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
  for wheel in "${WHEELS[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${platforms[@]}" --platform manylinux2014_x86_64 -d "$CARRY/wheels" "$wheel" || exit 1
  done
  "${PYTHON:-.venv/bin/python}" -c "
from cb_serve.model_executor.loader import default_model_source, load_tokenizer
load_tokenizer(default_model_source()).save_pretrained('$CARRY/tokenizer')" || exit 1
  read -r tree carry < <(travelling_bytes)
  echo "gpu_check carry: $((carry >> 10)) KiB in $CARRY; the tree: $((tree >> 10)) KiB; together" \
       "$(((tree + carry) >> 10)) KiB of $((MAX_BYTES >> 10)) KiB"
  [ $((tree + carry)) -le $MAX_BYTES ] || { echo "FAIL: over 64 MiB"; exit 1; }
  exit 0 ;;
--dry-run)
  PY=${PYTHON:-.venv/bin/python}
  for cmd in "$PY" timeout git du xargs; do command -v "$cmd" >/dev/null || { echo "FAIL: no $cmd"; exit 1; }; done
  # What runs there, imported and collected here with what the GPU machine lacks made unimportable.
  CB_SERVE_GPU_CHECK_BLOCK="ray fastapi flash_attn" "$PY" - "${GPU_TESTS[@]}" <<'EOF' || exit 1
import importlib.abc, importlib.util, os, sys
blocked = set(os.environ["CB_SERVE_GPU_CHECK_BLOCK"].split())
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"{name} (not on the GPU machine)", name=name)
sys.meta_path.insert(0, Block())
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: None if name.split(".")[0] in blocked else find_spec(name, package)
sys.path.insert(0, "bench")
import gpu_check  # noqa: F401  (every module the measurements use)
import pytest
rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu", *sys.argv[1:]])
sys.exit(0 if rc == 0 else 1)
EOF
  "$PY" -c "import importlib.metadata as m; [m.version(w.split('==')[0]) for w in '${WHEELS[*]}'.split()]" \
    || { echo "FAIL: a carried wheel is no dependency installed here"; exit 1; }
  "$PY" bench/gpu_check.py --help >/dev/null || exit 1
  echo "gpu_check dry run: OK"
  exit 0 ;;
esac

OUT=${1:-bench/out/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if compgen -G "$CARRY/wheels/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/cb_serve_site \
    "$CARRY"/wheels/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/cb_serve_site"
fi
[ -d "$CARRY/tokenizer" ] && export CB_SERVE_TEST_TOKENIZER="$PWD/$CARRY/tokenizer"
nvidia-smi -L 2>&1 | tee "$OUT/device.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
start=$(date +%s)
timeout 150 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs "${GPU_TESTS[@]}" 2>&1 | tee "$OUT/gpu_tests.log"
# (On the PyTorch attention backend: the C++ kernels' first build there would take minutes.)
CB_SERVE_CPU_OPS=0 timeout 60 "$PY" -m pytest -q -p no:cacheprovider -m "not gpu" tests/kernels/test_gpu_path.py 2>&1 | tee "$OUT/cpu_tests_on_gpu_host.log"
timeout 270 "$PY" bench/gpu_check.py ${GPU_CHECK_ARGS:-} --json "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log"
echo
echo "===== gpu_check summary ($(($(date +%s) - start)) s) ====="
echo "gpu tests:               $(tail -1 "$OUT/gpu_tests.log")"
echo "CPU tests on a GPU host: $(tail -1 "$OUT/cpu_tests_on_gpu_host.log")"
"$PY" - "$OUT/gpu_check.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except OSError:
    sys.exit("no gpu_check.json: the measurements did not finish (see gpu_check.log)")
print(r["device_name"], "torch", r["torch"], "triton", r["triton"], "transformers", r["transformers"])
for part in ("equality", "llama_1b", "many_blocks"):
    for key, value in r.get(part, {}).items():
        print(f"{part}.{key}: {json.dumps(value)}")
EOF
