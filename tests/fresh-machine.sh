#!/bin/sh
# make TARGET... (default: unit) in a fresh container of the node image, from a fresh clone of HEAD:
# a machine that never ran the tests, so a test that passes only on what an earlier run left behind
# (/opt/budgetgpu, a package, a file in /etc) fails here. Usage: tests/fresh-machine.sh [TARGET...]
#
# What a new user would do, on the node image (Debian 12, root): install make, git and gcc from the
# distribution, clone, make. The CPU torch wheel and the NVML bindings cannot come from PyPI here
# (build-machine.md): this checkout's .cache/wheelhouse and .cache/nvml-bindings are copied in
# (`make wheelhouse` fills them). pip reaches PyPI through the host's TLS-intercepting proxy: the
# container trusts the host's CA bundle.
set -eu
repo=$(cd "$(dirname "$0")/.." && pwd)
image=${BUDGETGPU_NODE_IMAGE:-budgetgpu-node:bookworm}
[ -d "$repo/.cache/wheelhouse" ] || { echo "$0: no .cache/wheelhouse: run make wheelhouse first" >&2; exit 1; }
docker image inspect "$image" >/dev/null 2>&1 || { echo "$0: no image $image: run make image first" >&2; exit 1; }

exec docker run --rm --name "budgetgpu-fresh-machine-$$" \
  -v "$repo:/src:ro" \
  -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/host-ca.crt:ro \
  -e PIP_CERT=/etc/ssl/certs/host-ca.crt -e PIP_DISABLE_PIP_VERSION_CHECK=1 \
  -e TARGETS="${*:-unit}" \
  "$image" bash -ec '
    echo "fresh-machine: installing make, git, gcc (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends make git gcc libc6-dev >/dev/null
    git config --global --add safe.directory "*"
    git clone --quiet /src /root/budgetgpu
    mkdir -p /root/budgetgpu/.cache
    cp -a /src/.cache/wheelhouse /src/.cache/nvml-bindings /root/budgetgpu/.cache/
    cd /root/budgetgpu
    echo "fresh-machine: $(git log --oneline -1)"
    echo "fresh-machine: before: $(ls -d /opt/budgetgpu /etc/budgetgpu /var/lib/budgetgpu 2>&1 | tr "\n" " ")"
    for target in $TARGETS; do
      start=$(date +%s)
      rc=0
      make "$target" || rc=$?
      echo "fresh-machine: make $target: exit $rc in $(($(date +%s) - start)) s"
      [ "$rc" -eq 0 ] || exit "$rc"
    done
    echo "fresh-machine: after: $(ls -d /opt/budgetgpu /etc/budgetgpu /var/lib/budgetgpu 2>&1 | tr "\n" " ")"
  '
