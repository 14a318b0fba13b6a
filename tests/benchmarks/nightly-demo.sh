#!/usr/bin/env bash
# Benchmark the nightly run over SSH, as on real nodes: fresh demo nodes (scripts/demo-cluster,
# nothing provisioned yet), then scripts/nightly-reprovision three times: the first provisioning
# run, a no-change run with the strategy it picks (mitogen_linear when installed), and a no-change
# run forced to linear. The job is held stopped (-e job_state=stopped) so that training does not
# compete with Ansible for the CPU. Figures: docs/benchmarks/nightly.md.
#
# Usage: tests/benchmarks/nightly-demo.sh [NODES]    (default 4; replaces a running demo cluster)
# Writes one JSON line per run to .cache/benchmarks/nightly-demo-<NODES>.jsonl; leaves the demo
# cluster up (make demo-down removes it).
set -euo pipefail
cd "$(dirname "$0")/../.."
nodes=${1:-4}
logs=.cache/benchmarks/nightly-demo-logs
out=.cache/benchmarks/nightly-demo-$nodes.jsonl
mkdir -p .cache/benchmarks
rm -rf "$logs" "$out"

scripts/demo-cluster down
DEMO_NODES=$nodes DEMO_SKIP_SITE=1 scripts/demo-cluster up | grep '^demo-cluster:'

for run in first no-change no-change-linear; do
  strategy=auto
  [ "$run" = no-change-linear ] && strategy=linear
  start=$(date +%s.%N)
  rc=0
  scripts/nightly-reprovision --log-dir "$logs" --keep 10 --strategy "$strategy" -- -e job_state=stopped \
    >"$logs.$run.txt" 2>&1 || rc=$?
  end=$(date +%s.%N)
  .venv/bin/python - "$run" "$rc" "$start" "$end" "$logs/latest/drift.json" >>"$out" <<'EOF'
import json, sys
run, rc, start, end, report = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
d = json.load(open(report))
nodes = {h: v["stats"] for h, v in d["hosts"].items() if h != "localhost"}
print(json.dumps({"run": run, "exit": rc, "wall_s": round(end - start, 1), "strategy": d["nightly"]["strategy"],
                  "changed": {h: s["changed"] for h, s in nodes.items()},
                  "failed": {h: s["failures"] for h, s in nodes.items()}}))
EOF
  tail -n 1 "$out"
done
