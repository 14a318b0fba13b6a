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

{
  part machine 20 bash -c "$(declare -f machine); machine"
  part smoke 60 python3 roles/probe/files/gpu-smoke
  python3 roles/probe/files/gpu-probe --json >"$out/gpu-probe.json" 2>/dev/null
  part sandbox 30 python3 roles/probe/files/gpu-smoke --sandbox-only --python python3
  part fsdp 220 python3 tests/benchmarks/fsdp_memory.py --cases gpt2-124m,gpt2-355m,gpt2-774m,gpt2-1.5b
  part fsdp-job 150 python3 roles/probe/files/gpu-smoke --fsdp --python python3
  part quant 100 python3 roles/probe/files/gpu-smoke --quant --python python3
  part trainer 200 python3 roles/probe/files/gpu-smoke --trainer --python python3
} 2>&1 | tee "$out/device-check.txt"
