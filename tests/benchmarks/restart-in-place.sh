#!/usr/bin/env bash
# Benchmark the in-place restart of a killed worker on the demo cluster, with the job's default
# max_restarts (3): kill -9 one worker of node2 KILLS times, and measure, from the kill, the
# seconds until rank 0 says it resumed from the checkpoint and until it logs its first training
# step after that. torchrun replaces the worker in place: the units' NRestarts must not move.
# Figures: docs/benchmarks/restart.md.
#
# Usage: tests/benchmarks/restart-in-place.sh [KILLS]     (default 3, the max_restarts of a job: a 4th kill is a systemd restart; needs `make demo` first)
# The demo's job is restarted with a step limit it will not reach (--max-steps 10000000) and
# --log-every 1; it keeps running afterwards (make demo-down removes the cluster).
set -euo pipefail
cd "$(dirname "$0")/../.."
kills=${1:-3}
unit=budgetgpu-job-demo.service
node1=budgetgpu-demo-node1 node2=budgetgpu-demo-node2
out=.cache/benchmarks/restart-in-place.jsonl
mkdir -p .cache/benchmarks
: >"$out"
export ANSIBLE_CONFIG=$PWD/ansible.cfg PATH=$PWD/.venv/bin:$PATH

docker inspect "$node1" "$node2" >/dev/null 2>&1 || { echo "restart-in-place: no demo cluster: run make demo first" >&2; exit 2; }
job='{"torchrun_jobs": [{"name": "demo", "script": "/opt/budgetgpu/examples/train_ddp.py",
  "args": ["--max-steps", "10000000", "--log-every", "1", "--step-sleep", "0.05"],
  "nproc_per_node": 2, "checkpoint_every_steps": 50, "checkpoint_every_minutes": 0}]}'
ansible-playbook -i inventory/demo playbooks/train.yml -e "$job" -e job_state=restarted >/dev/null
restarts() { for n in "$node1" "$node2"; do docker exec "$n" systemctl show -p NRestarts --value "$unit"; done | paste -sd,; }
# Seconds since the epoch of the first journal line on node1 since $1 that matches $2 (awk reads
# to the end: an early exit would end journalctl with SIGPIPE, and pipefail the script).
first_line_at() {
  docker exec "$node1" journalctl -q -u "$unit" -o short-unix --since "@$1" --no-pager \
    | awk -v re="$2" '!found && $0 ~ re {print $1; found=1}'
}

for i in $(seq "$kills"); do
  # Training, with a checkpoint behind it, before each kill.
  until docker exec "$node1" sh -c "journalctl -q -u $unit -n 3 --no-pager | grep -q '^.*step=.* world=4'"; do sleep 1; done
  sleep 8
  before=$(restarts)
  agent=$(docker exec "$node2" systemctl show -p MainPID --value "$unit")
  victim=$(docker exec "$node2" pgrep -P "$agent" -f train_ddp.py | head -n1)
  killed_at=$(date +%s.%N)
  docker exec "$node2" kill -9 "$victim"
  resumed_at='' stepped_at=''
  for _ in $(seq 120); do
    sleep 0.5
    resumed_at=$(first_line_at "${killed_at%.*}" 'resumed from step')
    [ -n "$resumed_at" ] || continue
    stepped_at=$(docker exec "$node1" journalctl -q -u "$unit" -o short-unix --since "@${resumed_at%.*}" --no-pager \
      | awk '/resumed from step/ {seen=1; next} seen && !found && /step=/ {print $1; found=1}')
    [ -n "$stepped_at" ] && break
  done
  after=$(restarts)
  python3 - "$i" "$killed_at" "${resumed_at:-0}" "${stepped_at:-0}" "$before" "$after" >>"$out" <<'EOF'
import json, sys
i, kill, resumed, stepped = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
print(json.dumps({"kill": i, "resumed_s": round(resumed - kill, 1) if resumed else None,
                  "training_s": round(stepped - kill, 1) if stepped else None,
                  "unit_restarts_before": sys.argv[5], "unit_restarts_after": sys.argv[6]}))
EOF
  tail -n 1 "$out"
done
python3 - "$out" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
times = [r["training_s"] for r in rows if r["training_s"] is not None]
moved = [r for r in rows if r["unit_restarts_before"] != r["unit_restarts_after"]]
print(f"restart-in-place: {len(times)}/{len(rows)} kills trained again; seconds to the first step after the kill: "
      f"median {statistics.median(times):.1f}, max {max(times):.1f}; unit restarts by systemd: {len(moved)}"
      if times else "restart-in-place: the job never trained again")
EOF
