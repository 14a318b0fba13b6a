#!/usr/bin/env bash
# The project's device check: everything a lent GPU machine is for, in one run of under 10 minutes
# (docs/benchmarks/device-check.md has the last run's output). From the checkout's root, on the lent
# machine (the device tool's run, carrying .whl: docs/benchmarks/inference.md, "Quantisation on a GPU",
# says how to download those wheels):
#
#   bash tests/benchmarks/device-check.sh [PART...]   # every part, or those named; writes $OUT/device-check.txt
#
# Each part has its own time limit, so that one hang costs its part only:
#   machine  the GPU, driver, python, torch; the device nodes and whether nvidia-uvm is loaded
#   smoke    roles/probe/files/gpu-smoke: the probe against nvidia-smi, field by field (and gpu-probe --json saved)
#   sandbox  roles/probe/files/gpu-smoke --sandbox-only (needs systemd as PID 1: says so where there is none)
#   fsdp     tests/benchmarks/fsdp_memory.py: measured memory of GPT-2 under FSDP2 (NCCL, world size 1), beside
#            the training memory planner's figure; then roles/probe/files/gpu-smoke --fsdp: the example trainer as an fsdp
#            job with bf16, its sharded checkpoint and its resume
#   quant    roles/probe/files/gpu-smoke --quant: the inference worker loads a tiny model in 4 and 8 bits
#   trainer  roles/probe/files/gpu-smoke --trainer: the example trainer with NCCL, once per gradient compression
#   rpc      (only when named: its build takes minutes) tests/benchmarks/llamacpp_rpc.py --local: llama-server alone
#            against llama-server --rpc to a ggml-rpc-server on the same GPU, tokens/s of 1 and 8 streams; first builds
#            both with CUDA from the pinned llama.cpp source carried in .cache/llama-src (no GPU:
#            scripts/build-llama-server's cached CPU build, to run the logic)
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/device-check}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
# budgetgpu_node as `make venv` gives the checkout (.venv/node-packages; here, with the machine's own python,
# the link alone: make node-package), and the collection by its name through the checkout's .collections link
# (the fsdp part prints the training memory planner's figure beside each measured peak).
make --no-print-directory node-package || exit 1
export PYTHONPATH=$PWD/.venv/node-packages:$PWD/.collections:/tmp/site PYTHONUNBUFFERED=1

wanted=" ${*:-machine smoke sandbox fsdp fsdp-job quant trainer} "
part() {
  local name=$1 limit=$2 start rc
  shift 2
  [[ $wanted == *" $name "* ]] || return 0
  start=$(date +%s)
  echo "=== $name"
  timeout "$limit" "$@"
  rc=$?
  echo "=== $name: exit $rc in $(($(date +%s) - start)) s"
}

machine() {
  nvidia-smi -L
  cat /proc/driver/nvidia/version 2>/dev/null | head -n 1
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
  echo "PID 1: $(ps -p 1 -o comm= 2>/dev/null || cat /proc/1/comm)"
  ls -l /dev/nvidia* 2>&1
  echo "loaded nvidia modules: $(grep -o '^nvidia[a-z_]*' /proc/modules 2>/dev/null | tr '\n' ' ')"
  ls /etc/modules-load.d /usr/lib/modules-load.d 2>&1 | tr '\n' ' '
  echo
}

# Both binaries with CUDA for this GPU alone, from scripts/build-llama-server's source (the pinned sdist's llama.cpp,
# carried as .cache/llama-src/llama.cpp-<its sha256's first 12>.tar.xz without models and docs: the machine has no
# network) with that script's own flags; without FlashAttention kernels (most of ggml-cuda's compile time: the build
# is the part's risk) and NCCL (one GPU).
rpc() {
  local bin build=/tmp/llama-cuda start flags sdist_sha256 source
  if nvidia-smi -L >/dev/null 2>&1; then
    command -v nvcc >/dev/null || { echo "no nvcc: no CUDA build of llama.cpp here"; return 1; }
    command -v cmake >/dev/null || { echo "no cmake: no CUDA build of llama.cpp here"; return 1; }
    eval "$(sed -n -e '/^sdist_sha256=/p' -e '/^flags=(/,/)$/p' scripts/build-llama-server)"
    source=.cache/llama-src/llama.cpp-${sdist_sha256:0:12}.tar.xz
    [ -f "$source" ] || { echo "no $source (docs/benchmarks/device-check.md says how to make it)"; return 1; }
    rm -rf "$build" && mkdir -p "$build" && tar -C "$build" -xJf "$source" || return 1
    start=$(date +%s)
    if ! { cmake -S "$build/llama.cpp" -B "$build/out" "${flags[@]}" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native \
             -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF \
           && cmake --build "$build/out" --target llama-server ggml-rpc-server -j "$(nproc)"; } >"$out/llama-build.log" 2>&1; then
      tail -n 30 "$out/llama-build.log"
      return 1
    fi
    echo "built llama-server and ggml-rpc-server with CUDA in $(($(date +%s) - start)) s ($(nvcc --version | grep -o 'release [0-9.]*'))"
    bin=$build/out/bin
  else
    echo "no GPU: scripts/build-llama-server's CPU build, to run the part's logic"
    bin=$(dirname "$(scripts/build-llama-server | tail -n 1)") || return 1
  fi
  python3 tests/benchmarks/llamacpp_rpc.py --local --bin "$bin" --json "$out/llamacpp-rpc.json"
}

{
  part machine 20 bash -c "$(declare -f machine); machine"
  part smoke 60 python3 roles/probe/files/gpu-smoke
  python3 roles/probe/files/gpu-probe --json >"$out/gpu-probe.json" 2>/dev/null
  part sandbox 30 python3 roles/probe/files/gpu-smoke --sandbox-only --python python3
  part fsdp 220 python3 tests/benchmarks/fsdp_memory.py --cases gpt2-124m,gpt2-355m,gpt2-774m,gpt2-1.5b
  part fsdp-job 150 python3 roles/probe/files/gpu-smoke --fsdp --python python3
  part quant 100 python3 roles/probe/files/gpu-smoke --quant --python python3
  part trainer 200 python3 roles/probe/files/gpu-smoke --trainer --python python3
  part rpc 360 bash -c "out=$out; $(declare -f rpc); rpc"
} 2>&1 | tee "$out/device-check.txt"
