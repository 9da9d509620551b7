#!/usr/bin/env bash
# GPU figures of vigil's diagnostic kernels, for a CUDA machine (made for one H200, <= 8 minutes).
#
# Self-contained: needs only a Python with a CUDA build of torch, Triton and vigil's runtime
# dependencies (msgspec, zstandard, pydantic-settings, rich, httpx, nvidia-ml-py, pytest), and nvcc
# plus ninja for the memory test (torch.utils.cpp_extension builds it). It lays vigil out as a wheel would (vigil/ with kernels/ inside) in a temp
# dir, so no install is needed, then:
#   1. runs the `gpu`-marked tests (compiled Triton kernels, bf16/fp8 GEMM, the CUDA memory test
#      built with torch.utils.cpp_extension, NVML, the quick suite) and counts passes/failures;
#   2. runs bench/diag_bench.py on cuda:0: GEMM 8192^3 bf16+fp8 (Triton vs cuBLAS), STREAM 2 GiB arrays
#      (Triton vs torch), SDC, a 10 s burn, the memory test over ~92 % of free memory.
# The last line of output is one JSON object: {"gemm_ratio_to_torch", "copy_ratio_to_torch",
# "memtest_coverage", "memtest_tb_per_s", "gpu_tests_passed", "gpu_tests_failed"}.
# Usage: bash bench/gpu/run.sh            (PYTHON=/path/to/python to pick the interpreter)
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT

pick_python() {
  for py in ${PYTHON:-} "$root/.venv/bin/python" python3 python; do
    [ -n "$py" ] && command -v "$py" >/dev/null 2>&1 || continue
    if "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
      echo "$py"; return 0
    fi
  done
  return 1
}
if ! py=$(pick_python); then
  echo "run.sh: no Python with a CUDA-enabled torch found (set PYTHON=...)" >&2
  exit 2
fi
missing=$("$py" - <<'PY'
import importlib.util
need = ["triton", "msgspec", "zstandard", "pydantic_settings", "rich", "httpx", "pynvml", "pytest", "ninja"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
  echo "run.sh: installing missing modules: $missing" >&2
  pkgs=$(echo "$missing" | sed 's/pydantic_settings/pydantic-settings/; s/pynvml/nvidia-ml-py/')
  # shellcheck disable=SC2086
  "$py" -m pip install -q $pkgs pytest-timeout >&2 || { echo "run.sh: cannot install $pkgs" >&2; exit 2; }
fi
if ! command -v nvcc >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break; done
fi
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")")}

cp -r "$root/vigil" "$tree/vigil"
cp -r "$root/kernels" "$tree/vigil/kernels"
cp -r "$root/agent" "$tree/vigil/agent"
mkdir -p "$tree/tests" && cp "$root/tests/__init__.py" "$tree/tests/" && cp -r "$root/tests/kernels" "$tree/tests/kernels"
# The SDK's CUDA collective timing (NCCL); not the agent tests' conftest (it needs the services).
mkdir -p "$tree/tests/agent" && cp "$root/tests/agent/__init__.py" "$root/tests/agent/test_collectives_cuda.py" "$tree/tests/agent/"
find "$tree" -name __pycache__ -prune -exec rm -rf {} +
export PYTHONPATH="$tree"
# One build of the CUDA memory test, shared by the tests and the figures below.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$tree/torch_extensions}
echo "python: $py  ($("$py" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))'))"
echo "nvcc: $(command -v nvcc || echo 'not found: the memory test cannot be built')"

echo "== gpu tests =="
(cd "$tree" && timeout 280 "$py" -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -o timeout=200 \
  --junitxml="$tree/gpu.xml" tests/kernels/test_gpu.py tests/agent/test_collectives_cuda.py 2>&1 | tail -25)
read -r passed failed < <("$py" - "$tree/gpu.xml" <<'PY'
import sys, xml.etree.ElementTree as ET
try:
    suite = ET.parse(sys.argv[1]).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, fail = int(suite.get("tests")), int(suite.get("failures")) + int(suite.get("errors"))
    print(total - fail - int(suite.get("skipped")), fail)
except Exception:
    print(0, 1)
PY
)

echo "== figures =="
cd "$tree" && timeout 170 "$py" "$root/bench/diag_bench.py" --device cuda \
  --gpu-tests-passed "$passed" --gpu-tests-failed "$failed"
status=$?
if [ $status -ne 0 ]; then
  echo "run.sh: diag_bench.py exited with $status" >&2
  printf '{"gemm_ratio_to_torch": 0.0, "copy_ratio_to_torch": 0.0, "memtest_coverage": 0.0, "memtest_tb_per_s": 0.0, "gpu_tests_passed": %d, "gpu_tests_failed": %d}\n' "$passed" "$failed"
  exit $status
fi
