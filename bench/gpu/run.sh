#!/usr/bin/env bash
# GPU checks and figures of vigil's GPU code, for a CUDA machine (made for one H200, <= 8 minutes).
#
# Self-contained: needs only a Python with a CUDA build of torch, Triton and vigil's runtime
# dependencies (numpy, msgspec, zstandard, pydantic-settings, rich, httpx, psutil, nvidia-ml-py,
# pytest), and nvcc plus ninja for the memory test (torch.utils.cpp_extension builds it). It lays
# vigil out as a wheel would (vigil/ with agent/, kernels/, recovery/ and trainer/ inside) in a
# temp dir, so no install is needed, then, each stage under a time cap and the whole script under
# one deadline (a stage that would run past it is cut short, or skipped and named):
#   1. the `gpu`-marked tests: compiled Triton kernels, bf16/fp8 GEMM, the CUDA memory test built
#      with torch.utils.cpp_extension, NVML, the quick suite (tests/kernels/test_gpu.py); the
#      SDK's CUDA-event timing of collectives on real NCCL (tests/agent/test_collectives_cuda.py);
#      the trainer's bf16 run on one GPU against the CPU run (tests/trainer/test_gpu.py);
#   1b. real 4-rank jobs on the GPU through the public SDK (tests/realjobs/test_cuda_jobs.py):
#      DDP and a plain all-reduce loop, a rank slowed on the device in each position, a data
#      stall and a clean jittery job, each analysed; the slow rank must be named from the
#      collectives' event-timed durations, the clean job must have no finding;
#   2. the node agent's NVML sampler for 10 s under a GEMM load, every field it claims printed
#      (bench/gpu/nvml_sample.py);
#   3. two NCCL processes on the one GPU where NCCL allows it (it says so when it refuses): the
#      all-reduce's result and bus bandwidth, and the SDK's device time of a member that waits
#      for a peer delayed on the device by a known time (bench/gpu/nccl_pair.py);
#   4. bench/diag_bench.py on cuda:0: GEMM 8192^3 bf16+fp8 (Triton vs cuBLAS), STREAM 2 GiB
#      arrays (Triton vs torch), SDC, a 10 s burn, the memory test over ~92 % of free memory;
#   5. Megatron-core's real forward-backward schedule timed by vigil.integrations.megatron, its
#      groups labelled (bench/gpu/megatron_check.py; Megatron's schedules need CUDA);
#   6. the trainer's ~1B recipe on one GPU in bf16, compiled: tokens/s and MFU against the
#      datasheet peak (bench/trainer.py --gpu-only).
# The last line of output is one JSON object (bench/gpu/summary.py): {"gemm_ratio_to_torch",
# "copy_ratio_to_torch", "memtest_coverage", "memtest_tb_per_s", "gpu_tests_passed",
# "gpu_tests_failed"}, then the real CUDA jobs' test counts ("cuda_jobs_passed",
# "cuda_jobs_failed"), the NVML figures ("nvml_*"), the NCCL pair's ("nccl_pair*"), the 1B
# recipe's ("gpu_1b_tokens_per_s", "gpu_1b_mfu"), the Megatron check's ("megatron_*") and
# "stages_failed".
# Usage: bash bench/gpu/run.sh            (PYTHON=/path/to/python to pick the interpreter;
#        VIGIL_GPU_DEADLINE_S: the whole script's deadline, 470 by default; VIGIL_GPU_STAGES:
#        the stages to run, e.g. "tests cuda_jobs" (names as below), all by default; a PYTHONPATH set
#        beforehand, e.g. to wheels carried to a machine without an index, is kept)
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
deadline=$((SECONDS + ${VIGIL_GPU_DEADLINE_S:-470})) # 8 minutes, less a margin for the summary and clean-up

pick_python() {
  for py in ${PYTHON:-} "$root/.venv/bin/python" python3 python; do
    [ -n "$py" ] && command -v "$py" >/dev/null 2>&1 || continue
    if "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
      echo "$py"
      return 0
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
need = ["triton", "numpy", "msgspec", "zstandard", "pydantic_settings", "rich", "httpx", "psutil",
        "pynvml", "pytest", "pytest_timeout", "ninja"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
  echo "run.sh: installing missing modules: $missing" >&2
  pkgs=$(echo "$missing" | sed 's/pydantic_settings/pydantic-settings/; s/pynvml/nvidia-ml-py/; s/pytest_timeout/pytest-timeout/')
  # shellcheck disable=SC2086
  "$py" -m pip install -q $pkgs >&2 || { echo "run.sh: cannot install $pkgs" >&2; exit 2; }
fi
if ! command -v nvcc >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break; done
fi
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")")}

cp -r "$root/vigil" "$tree/vigil"
for part in agent analyzer kernels recovery trainer integrations; do cp -r "$root/$part" "$tree/vigil/$part"; done
# Megatron-core for the megatron stage: the interpreter's own, else this checkout's .venv copy
# (pure Python; carry .venv/lib/python3.11/site-packages/megatron to a machine without it).
if ! "$py" -c 'import megatron.core' 2>/dev/null; then
  for d in "$root"/.venv/lib/python3*/site-packages/megatron; do [ -d "$d" ] && cp -r "$d" "$tree/megatron" && break; done
fi
mkdir -p "$tree/tests/agent" "$tree/tests/trainer" "$tree/tests/realjobs"
cp "$root/tests/__init__.py" "$tree/tests/"
cp -r "$root/tests/kernels" "$tree/tests/kernels"
# The SDK's CUDA collective timing (NCCL); not the agent tests' conftest (it needs the services).
cp "$root/tests/agent/__init__.py" "$root/tests/agent/test_collectives_cuda.py" "$tree/tests/agent/"
cp "$root/tests/trainer/__init__.py" "$root/tests/trainer/conftest.py" "$root/tests/trainer/test_gpu.py" "$tree/tests/trainer/"
for f in __init__.py launch.py train.py test_cuda_jobs.py; do cp "$root/tests/realjobs/$f" "$tree/tests/realjobs/"; done
find "$tree" -name __pycache__ -prune -exec rm -rf {} +
export PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" VIGIL_LOG_LEVEL=${VIGIL_LOG_LEVEL:-WARNING}
# One build of the CUDA memory test, shared by the tests and the figures below.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$tree/torch_extensions}
echo "python: $py  ($("$py" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))'))"
echo "nvcc: $(command -v nvcc || echo 'not found: the memory test cannot be built')"

stages=()
selected() { [ -z "${VIGIL_GPU_STAGES:-}" ] || [[ " $VIGIL_GPU_STAGES " == *" $1 "* ]]; }
# stage NAME CAP_S COMMAND...: run COMMAND in the tree for at most CAP_S seconds (less if the
# deadline is nearer; skipped under 10 s), its output shown and kept in $tree/NAME.out.
stage() {
  local name=$1 cap=$2 left status
  shift 2
  selected "$name" || return 0
  left=$((deadline - SECONDS))
  [ "$left" -lt "$cap" ] && cap=$left
  echo "== $name (at most ${cap} s) =="
  if [ "$cap" -lt 10 ]; then
    echo "run.sh: no time left for $name" | tee "$tree/$name.out" >&2
    stages+=(--stage "$name" "$tree/$name.out" skipped)
    return
  fi
  (cd "$tree" && timeout -k 5 "$cap" "$@") 2>&1 | tee "$tree/$name.out"
  status=${PIPESTATUS[0]}
  [ "$status" -eq 124 ] && echo "run.sh: $name ran past ${cap} s and was stopped" >&2
  stages+=(--stage "$name" "$tree/$name.out" "$status")
}

passed=0 failed=0
if selected tests; then
  left=$((deadline - SECONDS))
  echo "== tests: the gpu-marked tests (at most $((left < 170 ? left : 170)) s) =="
  (cd "$tree" && timeout -k 5 $((left < 170 ? left : 170)) "$py" -m pytest -q -m gpu -rfE \
    --tb=short -p no:cacheprovider -o addopts="" -o timeout=150 --junitxml="$tree/gpu.xml" \
    tests/kernels/test_gpu.py tests/agent/test_collectives_cuda.py tests/trainer/test_gpu.py 2>&1 |
    tail -60)
  read -r passed failed < <("$py" "$root/bench/gpu/summary.py" --junit "$tree/gpu.xml" --counts)
else
  echo '<testsuite tests="0"/>' >"$tree/gpu.xml" # not run: no test counted, none failed
fi

stage cuda_jobs 150 "$py" -m pytest -q -s -p no:cacheprovider -o addopts="" \
  --junitxml="$tree/cuda_jobs.xml" tests/realjobs/test_cuda_jobs.py
if selected cuda_jobs; then
  "$py" "$root/bench/gpu/summary.py" --junit "$tree/cuda_jobs.xml" --counts-as cuda_jobs |
    tee -a "$tree/cuda_jobs.out"
fi
stage nvml 25 "$py" "$root/bench/gpu/nvml_sample.py" --seconds 10
stage nccl_pair 45 "$py" "$root/bench/gpu/nccl_pair.py" --delay-ms 50 --timeout 40
stage figures 140 "$py" "$root/bench/diag_bench.py" --device cuda \
  --gpu-tests-passed "$passed" --gpu-tests-failed "$failed"
stage megatron 40 "$py" "$root/bench/gpu/megatron_check.py" --steps 10
# Last, with whatever time is left (about 50 s when the stages above take their caps): the
# recipe compiles each block first (most of it), then 12 steps, the first 5 left out.
stage trainer_1b 200 "$py" "$root/bench/trainer.py" --gpu-only --gpu-steps 12

"$py" "$root/bench/gpu/summary.py" --junit "$tree/gpu.xml" "${stages[@]}"
