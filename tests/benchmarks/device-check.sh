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
#   image    an image job's GPUs as the collection gives them (docs/job-images.md), where Docker, the NVIDIA container
#            toolkit and a C compiler are (else one line, exit 77: skipped). A tiny image is built here, no registry:
#            a CUDA check (cuInit, the devices' UUIDs) and the host's C library, docker import'ed. The job unit runs
#            no engine (systemd's RootDirectory=); it takes from the toolkit only the driver's libraries, its list.
#            So, first the toolkit's own injection, `docker run --gpus device=<UUID>` (read-only, no new privileges,
#            uid 65534, the GPU's group): CUDA sees that GPU alone, and each library the toolkit mounts is in the list
#            the job unit binds (tasks/images.yml's own `nvidia-container-cli list --libraries` command, run as
#            written there); without --gpus, no GPU. Then, with systemd as PID 1 (else that half says so), the unit's
#            way: the image unpacked as tasks/images.yml does (docker create, docker export | tar) and a transient
#            unit with the job unit's settings (the torchrun role's sandbox as gpu-smoke reads it, the template's
#            image overrides, RootDirectory=, MountAPIVFS=, the list bound at /usr/local/nvidia/lib64, DeviceAllow= of
#            one GPU): CUDA sees that GPU alone; with DeviceAllow= of no GPU (nvidiactl kept), none. It cannot show:
#            GPUs split between jobs (one GPU here: "the others" is the unit without its own), the launcher's
#            CUDA_VISIBLE_DEVICES and quarantine, torch or NCCL in an image (no such image without a registry), the
#            rendered unit file itself (no Ansible there: its settings are assembled from the same sources)
#   rpc      (only when named: its build takes minutes) tests/benchmarks/llamacpp_rpc.py --local: llama-server alone
#            against llama-server --rpc to a ggml-rpc-server on the same GPU, tokens/s of 1 and 8 streams; first builds
#            both with CUDA from the pinned llama.cpp source carried in .cache/llama-src (no GPU:
#            scripts/build-llama-server's cached CPU build, to run the logic)
set -u
cd "$(dirname "$0")/../.." || exit 1
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

wanted=" ${*:-machine smoke sandbox fsdp fsdp-job quant trainer image} "
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
  # shellcheck disable=SC2012  # a listing to read, a missing folder's error included
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

# What CUDA sees, printed as one line: "devices N GPU-<uuid>...", or "no GPU: <why>" (libcuda.so.1 dlopened from the
# library path, as an image's CUDA runtime finds the driver's). With --mounts: the mount points of its mount table.
image_cuda_check() {
  cat <<'C'
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
typedef int (*init_fn)(unsigned int);
typedef int (*count_fn)(int *);
typedef int (*get_fn)(int *, int);
typedef int (*uuid_fn)(unsigned char *, int);
int main(int argc, char **argv) {
  char line[4096], point[4096];
  if (argc > 1 && strcmp(argv[1], "--mounts") == 0) {
    FILE *mounts = fopen("/proc/self/mountinfo", "r");
    while (mounts && fgets(line, sizeof line, mounts))
      if (sscanf(line, "%*s %*s %*s %*s %4095s", point) == 1) puts(point);
    return mounts ? 0 : 1;
  }
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
  if (!cuda) { printf("no GPU: %s\n", dlerror()); return 0; }
  init_fn cu_init = (init_fn)dlsym(cuda, "cuInit");
  count_fn cu_count = (count_fn)dlsym(cuda, "cuDeviceGetCount");
  get_fn cu_get = (get_fn)dlsym(cuda, "cuDeviceGet");
  uuid_fn cu_uuid = (uuid_fn)dlsym(cuda, "cuDeviceGetUuid");
  if (!cu_init || !cu_count || !cu_get || !cu_uuid) { printf("no GPU: a CUDA driver entry point is missing\n"); return 1; }
  int count = 0, rc = cu_init(0);
  if (rc != 0) { printf("no GPU: cuInit error %d\n", rc); return 0; }
  cu_count(&count);
  printf("devices %d", count);
  for (int i = 0; i < count; i++) {
    int device;
    unsigned char u[16];
    cu_get(&device, i);
    cu_uuid(u, device);
    printf(" GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1], u[2], u[3], u[4],
           u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
  }
  putchar('\n');
  return 0;
}
C
}

# The transient unit's settings, one KEY=value a line, for an image job of the GPUs of these minors (none: only
# nvidiactl's): the torchrun role's sandbox as gpu-smoke reads it (its defaults, budgetgpu_node.unit_sandbox) as
# uid nobody, the job's own GPUs (budgetgpu_node.device_allow), the image overrides of the job unit's template
# (read from it), and its image lines: RootDirectory=, MountAPIVFS=, the driver's libraries bound read-only.
image_unit_settings() {
  python3 - "$@" <<'PY'
import ast, grp, importlib.machinery, importlib.util, re, sys
from pathlib import Path
from budgetgpu_node import device_allow
root, libraries, minors = sys.argv[1], sys.argv[2], [int(minor) for minor in sys.argv[3:]]
loader = importlib.machinery.SourceFileLoader("gpu_smoke", "roles/probe/files/gpu-smoke")
smoke = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
loader.exec_module(smoke)
everyone = set(device_allow.gpu_device_allow(smoke.node_gpu_minors()))
settings = [(key, value) for key, value in smoke.role_properties(user="nobody") if (key, value) not in
            {("DeviceAllow", entry) for entry in everyone}]
settings += [("DeviceAllow", entry) for entry in device_allow.gpu_device_allow(minors)]
try:
    grp.getgrnam(device_allow.GPU_GROUP)
except KeyError:  # not a node of the collection: the device files are not that group's
    settings = [(key, value) for key, value in settings if key != "SupplementaryGroups"]
template = Path("roles/torchrun/templates/budgetgpu-job.service.j2").read_text()
image = ast.literal_eval(re.search(r"combine\((\{'ProtectSystem'.*?\})\)", template, re.S)[1])
settings = [(key, value) for key, value in settings if key not in image] + list(image.items())
settings += [("RootDirectory", root), ("MountAPIVFS", "yes")]
settings += [("Environment", "LD_LIBRARY_PATH=/usr/local/nvidia/lib64")]
settings += [("BindReadOnlyPaths", f"{library}:/usr/local/nvidia/lib64/{Path(library).name}")
             for library in Path(libraries).read_text().split()]
print("\n".join(f"{key}={value}" for key, value in settings))
PY
}

# Prints the PASS or FAIL line of one look of the CUDA check; returns 1 on a FAIL. $1: what ran, $2: what it saw,
# $3: the pattern it must match.
image_verdict() {
  # shellcheck disable=SC2053  # $3 is a pattern
  if [[ $2 == $3 ]]; then echo "image  PASS $1: $2"; else echo "image  FAIL $1: $2 (expected $3)"; return 1; fi
}

# work, image_id and container are globals, not locals: the EXIT trap removes them after the function returned.
image() {
  local missing=() why uuid minor gpu expected rc=0 library injected props=() run
  nvidia-smi -L >/dev/null 2>&1 || missing+=("no GPU (nvidia-smi -L)")
  docker info >/dev/null 2>&1 || missing+=("no Docker engine (docker info)")
  nvidia-container-cli info >/dev/null 2>&1 || missing+=("no NVIDIA container toolkit (nvidia-container-cli info)")
  command -v cc >/dev/null || missing+=("no C compiler")
  if ((${#missing[@]})); then
    printf -v why '%s, ' "${missing[@]}"
    echo "image: skipped: ${why%, } here"
    return 77
  fi
  IFS=', ' read -r uuid minor < <(nvidia-smi --query-gpu=uuid,minor_number --format=csv,noheader -i 0)
  expected="devices 1 $uuid"
  work=$(mktemp -d /tmp/budgetgpu-image-check.XXXXXX) || return 1
  trap 'docker rm --force "${container:-none}" >/dev/null 2>&1; docker image rm "${image_id:-none}" >/dev/null 2>&1
        rm -rf "$work"' EXIT
  # The driver's libraries the job unit binds: tasks/images.yml's own command, as written there.
  python3 -c 'import sys, yaml
name = "List the driver'"'"'s user-space libraries the toolkit injects"
task = next(task for task in yaml.safe_load(open(sys.argv[1])) if task.get("name") == name)
print(task["ansible.builtin.shell"]["cmd"])' \
    roles/torchrun/tasks/images.yml >"$work/list.sh" || return 1
  bash "$work/list.sh" | grep '^/' | sort -u >"$work/libraries"
  sed 's|.*/||' "$work/libraries" >"$work/names"
  if ! [ -s "$work/libraries" ]; then
    echo "image  FAIL: the toolkit lists no driver library (nvidia-container-cli list --libraries)"
    return 1
  fi
  echo "image  the job unit binds $(wc -l <"$work/libraries") driver libraries and their links (the toolkit's list)"
  # The image: the check and the host's C library (what it and libcuda need, not the driver's own), docker import'ed.
  image_cuda_check >"$work/check.c" && cc -O2 -o "$work/check" "$work/check.c" -ldl || return 1
  mkdir -p "$work/rootfs"/{proc,sys,dev,tmp,etc} && install -m 0755 "$work/check" "$work/rootfs/check" || return 1
  for library in $( { ldd "$work/check"; ldd "$(grep -m 1 '/libcuda\.so\.' "$work/libraries")"; } |
                    grep -o '/[^ ]*' | sort -u); do
    grep -qxF "$library" "$work/libraries" || cp --parents -L "$library" "$work/rootfs" || return 1
  done
  image_id=$(tar -C "$work/rootfs" -c . | docker import -) || return 1
  echo "image  built $image_id ($(du -sh "$work/rootfs" | cut -f1)) with no registry"

  # The toolkit's injection: that GPU alone, and every library it mounts among those the unit binds. The group of
  # the GPU's device file, as the job unit has it (SupplementaryGroups=: mode 0660 on the collection's nodes).
  run=(docker run --rm --network none --read-only --security-opt no-new-privileges --user 65534:65534
       --group-add "$(stat -c %g "/dev/nvidia$minor")"
       -e LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/lib/x86_64-linux-gnu:/usr/lib64)
  image_verdict "docker --gpus device=$uuid" "$("${run[@]}" --gpus "device=$uuid" "$image_id" /check 2>&1)" \
    "$expected" || rc=1
  injected=$("${run[@]}" --gpus "device=$uuid" "$image_id" /check --mounts | grep -E '/lib[^/]*\.so[.0-9]*$' | sort -u)
  for library in $injected; do
    if ! grep -qxF "${library##*/}" "$work/names"; then
      echo "image  FAIL the toolkit mounts $library, which the job unit does not bind"
      rc=1
    fi
  done
  echo "image  docker --gpus mounted $(wc -w <<<"$injected") driver libraries, each among the job unit's"
  image_verdict "docker without --gpus" "$("${run[@]}" "$image_id" /check 2>&1)" "no GPU*" || rc=1

  # The job unit's way (it runs no engine): the image unpacked as tasks/images.yml does, a transient unit in it.
  if [ "$(cat /proc/1/comm)" != systemd ]; then
    echo "image  the job unit's way not run: PID 1 is $(cat /proc/1/comm), not systemd (systemd-run needs it)"
    return "$rc"
  fi
  mkdir -m 0755 "$work/root" && container=$(docker create --network none "$image_id" /check) &&
    docker export "$container" | tar --extract --same-permissions --numeric-owner --directory "$work/root" || return 1
  for gpu in "$minor" ""; do
    readarray -t props < <(image_unit_settings "$work/root" "$work/libraries" ${gpu:+"$gpu"})
    image_verdict "the job unit with DeviceAllow= of ${gpu:+/dev/nvidia}${gpu:-no GPU}" \
      "$(systemd-run --quiet --wait --pipe --collect "${props[@]/#/-p}" -- /check </dev/null 2>&1)" \
      "${gpu:+$expected}${gpu:-no GPU*}" || rc=1
  done
  return "$rc"
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
  part image 180 bash -c "$(declare -f image_cuda_check image_unit_settings image_verdict image); image"
  part rpc 360 bash -c "out=$out; $(declare -f rpc); rpc"
} 2>&1 | tee "$out/device-check.txt"
