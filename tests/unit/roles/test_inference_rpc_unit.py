"""roles/inference's llama.cpp RPC server (issue 43 item 1) as the role renders it for a worker over two nodes of
two GPUs each: the unit (budgetgpu-infer-rpc.service.j2, the workers' user and sandbox) and each server's drop-in
(rpc-server.conf.j2: its GPUs pinned as a worker's, its node's cluster address and port, its cache directory), and
the firewall table (role _firewall's template) admitting the worker's head alone to the RPC ports."""

from __future__ import annotations

import re
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference import engines, services
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.gateway import inference_firewall_ports
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.plan import inference_plan
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import systemd_exec
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import output_of, run_playbook
from ansible_collections.budgetgpu.cluster.tests.unit.roles.test_firewall import render, rules, sets
from ansible_collections.budgetgpu.cluster.tests.unit.roles.test_prometheus_rules import alerts, render_rules

REPO = Path(__file__).resolve().parents[3]
UUIDS = [f"GPU-3090000{i}-5a1e-4c0d-9b7e-00000000000{i}" for i in range(2)]
HOSTVARS = {
    f"node{n}": {
        "group_names": ["inference_nodes"],
        "ansible_facts": {
            "budgetgpu_gpus": {
                "gpus": [
                    {"index": i, "uuid": u.replace("3090", f"{n}090"), "memory_total_mib": 24576}
                    for i, u in enumerate(UUIDS)
                ]
            }
        },
        "ansible_host": f"10.0.0.1{n}",
    }
    for n in (1, 2)
}
SERVICE = services.inference_services_normalize(
    [
        {
            "name": "chat",
            "engine": "llamacpp",
            "model": "/srv/models/tiny.gguf",
            "task": "generation",
            "nodes": ["node1", "node2"],
            "nodes_per_worker": 2,
            "model_shape": {"layers": 2, "kv_heads": 2, "head_dim": 32},
            "port": 8100,
        }
    ]
)[0]
PLAYBOOK = """\
- name: Render one llama.cpp RPC server's unit and drop-in as role inference does
  hosts: all
  gather_facts: false
  vars_files:
    - "{{ test_repo }}/roles/inference/vars/main.yml"
  tasks:
    - name: Render the unit template
      ansible.builtin.template:
        src: "{{ test_repo }}/roles/inference/templates/budgetgpu-infer-rpc.service.j2"
        dest: "{{ test_out }}/unit"
        mode: "0644"
      vars:
        _inference_svc: "{{ test_plan }}"

    - name: Render the drop-in of each server
      ansible.builtin.template:
        src: "{{ test_repo }}/roles/inference/templates/rpc-server.conf.j2"
        dest: "{{ test_out }}/{{ _inference_rpc_pair.1.slot }}.conf"
        mode: "0644"
      loop: "{{ [test_plan] | subelements('rpc_servers') }}"
      loop_control:
        loop_var: _inference_rpc_pair
"""


@pytest.fixture(name="files", scope="module")
def fixture_files(tmp_path_factory) -> dict[str, str]:
    """node2's RPC unit and drop-ins as the role renders them (one playbook run for the module)."""
    tmp_path = tmp_path_factory.mktemp("rpc")
    plan = inference_plan(SERVICE, HOSTVARS, "node2", list(HOSTVARS), [])
    out = tmp_path / "out"
    out.mkdir()
    result = run_playbook(
        tmp_path, PLAYBOOK, {"test_repo": str(REPO), "test_out": str(out), "test_plan": plan}, host="node2"
    )
    assert result.returncode == 0, output_of(result)
    return {path.name: path.read_text() for path in out.iterdir()}


def directives(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith(("#", "["))]


def test_the_rpc_server_runs_as_the_workers_user_in_the_workers_sandbox(files):
    unit = directives(files["unit"])
    assert "User=budgetgpu-infer" in unit and "Group=budgetgpu-infer" in unit
    # The workers' sandbox, from the one template both units include.
    worker = (REPO / "roles/inference/templates/budgetgpu-infer.service.j2").read_text()
    assert "{% include 'unit-sandbox.j2' %}" in worker
    for line in ("NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
                 "CapabilityBoundingSet=", "DevicePolicy=closed", "DeviceAllow=char-nvidia-uvm rw"):  # fmt: skip
        assert line in unit, line
    assert "Restart=always" in unit
    assert "ExecStartPre=+/bin/rm -f /var/lib/budgetgpu/inference/%n.restart-pending" in unit
    # -c's cache: each instance's own directory that systemd makes for its user (the workers' CacheDirectory=).
    assert "CacheDirectory=%N" in unit and "Environment=LLAMA_CACHE=%C/%N" in unit


def test_each_rpc_server_is_pinned_to_its_gpus_listens_on_the_cluster_address_and_caches_in_its_own_directory(
    files,
):
    for slot in (0, 1):
        conf = directives(files[f"{slot}.conf"])
        uuid = UUIDS[slot].replace("3090", "2090")
        # One GPU each (gpus_per_worker 1), by UUID, and only its device node beside the control ones.
        assert f"Environment=CUDA_VISIBLE_DEVICES={uuid} CUDA_DEVICE_ORDER=PCI_BUS_ID" in conf
        gpus = [line for line in conf if line.startswith("DeviceAllow=/dev/char/195:")]
        assert f"DeviceAllow=/dev/char/195:{slot} rw" in gpus
        assert f"DeviceAllow=/dev/char/195:{1 - slot} rw" not in gpus
        health = 'ExecCondition=/bin/sh -c \'test ! -x "$1" || exec "$1" check "$2"\' sh /usr/local/bin/gpu-health'
        assert f"{health} {uuid}" in conf
        # Its cache is its own systemd cache directory (/var/cache/<unit>@<slot>), the only place it may write.
        assert not [line for line in conf if line.startswith(("ReadWritePaths=", "Environment=LLAMA_CACHE="))]
        binary = "/usr/local/lib/budgetgpu/ggml-rpc-server"
        assert f'ExecStart="{binary}" "--host" "10.0.0.12" "--port" "{8100 + slot}" "--cache"' in conf


def test_the_rpc_ports_admit_the_head_alone_another_node_and_an_outsider_are_reset():
    plan = inference_plan(SERVICE, HOSTVARS, "node2", list(HOSTVARS), [])
    entries = inference_firewall_ports([], [], ["monitor"], [], [plan])
    text = render(entries, "budgetgpu_inference", passwd={"root": ["x", "0"], "budgetgpu-infer": ["x", "998"]})
    assert rules(text) == [
        "tcp dport { 8100, 8101 } ip saddr @chat_rpc_servers_of_node1_v4 accept",
        "tcp dport { 8100, 8101 } ip6 saddr @chat_rpc_servers_of_node1_v6 accept",
        'tcp dport { 8100, 8101 } counter reject with tcp reset comment "budgetgpu: chat RPC servers of node1, the head'
        ' node1 only"',
        # From the node itself, root alone (not the workers' user, nor a job's).
        "tcp dport { 8100, 8101 } ct state new fib daddr type local meta skuid != { 0 } counter reject with tcp reset"
        ' comment "budgetgpu: chat RPC servers of node1, from this node root only"',
    ]
    found = sets(text)
    # The head's addresses only (render's facts: node1 has 10.0.0.11, monitor 10.0.0.13 and fd00::13): node2
    # itself (10.0.0.12), Prometheus (monitor) and anyone else get the reset.
    assert "elements = { 10.0.0.11 }" in found["chat_rpc_servers_of_node1_v4"]
    assert "elements" not in found["chat_rpc_servers_of_node1_v6"]


def test_on_the_head_only_its_llama_servers_user_reaches_its_rpc_servers_on_other_nodes():
    """Node2's RPC ports admit node1's addresses, whichever process on node1 sends from them: node1 itself lets only
    the service's user (its llama-server) and root connect there, and serves nothing on those ports."""
    plan = inference_plan(SERVICE, HOSTVARS, "node1", list(HOSTVARS), [], {"ci": "k" * 32})
    entries = inference_firewall_ports([plan], [], ["monitor"], [], [])
    text = render(entries, "budgetgpu_inference", passwd={"budgetgpu-infer": ["x", "998"], "www-data": ["x", "33"]})
    assert [rule.split(" counter ")[0] for rule in rules(text) if "rpc_servers" in rule] == [
        "tcp dport { 8100, 8101 } ct state new ip daddr @chat_rpc_servers_on_node2_v4 meta skuid != { 0, 998 }",
        "tcp dport { 8100, 8101 } ct state new ip6 daddr @chat_rpc_servers_on_node2_v6 meta skuid != { 0, 998 }",
    ]
    assert "elements = { 10.0.0.12 }" in sets(text)["chat_rpc_servers_on_node2_v4"]
    # node2, where the RPC servers run and no worker is headed: no such entry.
    node2 = inference_plan(SERVICE, HOSTVARS, "node2", list(HOSTVARS), [], {"ci": "k" * 32})
    assert not [e for e in inference_firewall_ports([node2], [], ["monitor"], [], []) if e.get("client_only")]


HEAD_PLAYBOOK = """\
- name: Render the head's drop-in and bring its unit to its state as role inference does
  hosts: all
  gather_facts: false
  # systemctl: a fake that logs its arguments (FAKE_SYSTEMCTL).
  environment:
    PATH: "{{ test_bin }}:{{ lookup('ansible.builtin.env', 'PATH') }}"
  vars_files:
    - "{{ test_repo }}/roles/inference/defaults/main.yml"
    - "{{ test_repo }}/roles/inference/vars/main.yml"
  vars:
    _inference_plan: ["{{ test_plan }}"]
    _inference_rpc_plan: []
    budgetgpu_disruption_allowed: true
  tasks:
    - name: Render
      ansible.builtin.template:
        src: "{{ test_repo }}/roles/inference/templates/worker.conf.j2"
        dest: "{{ test_bin }}/../worker.conf"
        mode: "0644"
      vars:
        _inference_worker_script: /opt/budgetgpu/inference/inference_worker.py
        _inference_llama_server: /usr/local/lib/budgetgpu/llama-server
        _inference_pair: "{{ [test_plan, test_plan.workers[0]] }}"

    - name: Run
      ansible.builtin.import_tasks: "{{ test_repo }}/roles/inference/tasks/run.yml"
"""
# `systemctl show` answers that the head is failed (its start limit hit) and enabled; every call is logged.
FAKE_SYSTEMCTL = """\
#!/bin/sh
echo "$*" >> "$(dirname "$0")/calls"
[ "$1" = show ] || exit 0
printf 'Id=%s\\nLoadState=loaded\\nActiveState=failed\\nSubState=failed\\nUnitFileState=enabled\\n\\n' "$3"
"""
HEAD_PLAN = inference_plan(SERVICE, HOSTVARS, "node1", list(HOSTVARS), [], {"ci": "k" * 32})


def run_head(tmp_path: Path, plan: dict) -> dict:
    """One run of HEAD_PLAYBOOK on node1: {conf: the head's drop-in, calls: the systemctl command lines}."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "systemctl").write_text(FAKE_SYSTEMCTL)
    (bin_dir / "systemctl").chmod(0o755)
    extra = {"test_repo": str(REPO), "test_bin": str(bin_dir), "test_plan": plan}
    result = run_playbook(tmp_path, HEAD_PLAYBOOK, extra, host="node1")
    assert result.returncode == 0, output_of(result)
    return {"conf": (tmp_path / "worker.conf").read_text(), "calls": (bin_dir / "calls").read_text().splitlines()}


@pytest.fixture(name="head", scope="module")
def fixture_head(tmp_path_factory) -> dict:
    return run_head(tmp_path_factory.mktemp("head"), HEAD_PLAN)


def test_the_head_waits_for_its_rpc_servers_and_a_node_that_stays_down_stops_its_restarts(head):
    text = head["conf"]
    conf = directives(text)
    # Before llama-server: the wait for node2's two RPC servers (30 s), then a restart 2 s after a failure...
    wait = engines.inference_rpc_wait_command(HEAD_PLAN["workers"][0], 30)
    assert wait[-3:] == ["node2", "10.0.0.12", "8100"], wait
    assert f"ExecStartPre={systemd_exec(wait)}" in conf
    assert "RestartSec=2" in conf
    # ...at most 5 starts in 10 minutes: an RPC node that stays down fails the head, not a loop.
    unit_section = text[text.index("[Unit]") :]
    assert "StartLimitIntervalSec=600" in unit_section and "StartLimitBurst=5" in unit_section
    # A worker of one node waits for nothing.
    single = inference_plan(SERVICE | {"nodes_per_worker": 1}, HOSTVARS, "node1", list(HOSTVARS), [], {"ci": "k" * 32})
    assert not single["workers"][0]["rpc_servers"]


def test_the_run_after_an_rpc_node_comes_back_clears_the_heads_start_limit_before_it_starts_it(head):
    # A head that hit its start limit is refused by systemd at any start, by hand too, until its window
    # (inference_rpc_start_limit_s) ends: the role's run clears it with reset-failed first.
    unit = HEAD_PLAN["workers"][0]["unit"]
    assert head["calls"][1:] == [f"reset-failed {unit}", f"enable --now {unit}"], head["calls"]


def test_the_heads_wait_passes_once_each_rpc_server_answers_and_fails_naming_a_node_that_does_not():
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refused
        up, down = (str(s.getsockname()[1]) for s in (listening, closed))
        servers = [{"host": "node2", "address": "127.0.0.1", "port": up}]
        answered = subprocess.run(
            engines.inference_rpc_wait_command({"rpc_servers": servers}, 5), capture_output=True, text=True, check=False
        )
        assert answered.returncode == 0, answered.stderr
        servers.append({"host": "node3", "address": "127.0.0.1", "port": down})
        start = time.monotonic()
        refused = subprocess.run(
            engines.inference_rpc_wait_command({"rpc_servers": servers}, 2), capture_output=True, text=True, check=False
        )
    assert refused.returncode == 1 and time.monotonic() - start < 10, refused
    assert f"the llama.cpp RPC server of node node3 (127.0.0.1 port {down}) does not answer after 2 s" in refused.stderr


def test_a_head_failed_at_its_start_limit_is_a_unit_the_failed_unit_alert_watches():
    # The head left failed at its start limit (systemd's ActiveState failed) is node exporter's
    # node_systemd_unit_state{name=<head>, state="failed"} 1, which BudgetgpuUnitFailed selects (its promtool test:
    # tests/prometheus/rules_test.yml). molecule/inference (no node exporter) sees BudgetgpuInferenceWorkerDown.
    unit = HEAD_PLAN["workers"][0]["unit"]
    exporter = yaml.safe_load((REPO / "roles" / "node_exporter" / "defaults" / "main.yml").read_text())
    assert re.fullmatch(exporter["node_exporter_systemd_units"], unit), (exporter, unit)
    expr = alerts(render_rules())["BudgetgpuUnitFailed"]["expr"]
    selected = re.search(r'name=~"([^"]+)"', expr)
    assert selected and re.fullmatch(selected.group(1), unit) and 'state="failed"' in expr, (expr, unit)


# The head's own GPUs where its llama-server has no GPU device (a build without a GPU backend): an RPC server of its
# own on loopback, the last of --rpc, so that its layers land on its node as with a GPU build.
OWN_PLAN = inference_plan(SERVICE, HOSTVARS, "node1", list(HOSTVARS), [], {"ci": "k" * 32}, head_rpc=True)


def test_llama_servers_device_list_tells_whether_the_head_serves_its_gpus_through_an_rpc_server_of_its_own():
    server = "/usr/local/lib/budgetgpu/llama-server"

    def probe(stdout: str) -> list[dict]:
        return [{"item": {"src": "/c/ggml-rpc-server", "dest": "/x/ggml-rpc-server"}, "stdout": "usage"},
                {"item": {"src": "/c/llama-server", "dest": server}, "stdout": stdout}]  # fmt: skip

    # scripts/build-llama-server's CPU build, as it answers (llama-server --list-devices).
    assert engines.llamacpp_head_rpc(probe("Available devices:\n  (none)\n"), server)
    cuda = "Available devices:\n  CUDA0: NVIDIA GeForce RTX 3090 (24135 MiB, 23867 MiB free)\n"
    assert not engines.llamacpp_head_rpc(probe(cuda), server)
    # Not probed (check mode, no llama.cpp on the node): the plan as without the fact.
    assert not engines.llamacpp_head_rpc([], server)


def test_a_head_without_a_gpu_device_reaches_its_own_gpus_through_its_rpc_server_last_in_rpc_on_loopback():
    worker = OWN_PLAN["workers"][0]
    # node2's server, then the head's own: device order and tensor split as a head with GPUs has them.
    assert [(s["host"], s["address"], s["port"], s["gpu_uuids"]) for s in worker["rpc_servers"]] == [
        ("node2", "10.0.0.12", 8100, [UUIDS[0].replace("3090", "2090")]),
        ("node1", "127.0.0.1", 8102, [UUIDS[0].replace("3090", "1090")]),
    ]
    assert worker["tensor_split"] == HEAD_PLAN["workers"][0]["tensor_split"] == [1, 1]
    argv = engines.inference_llamacpp_command(SERVICE, worker, "/usr/local/lib/budgetgpu/llama-server")
    assert argv[argv.index("--rpc") + 1] == "10.0.0.12:8100,127.0.0.1:8102", argv
    # The plan's RPC servers on the head are its own (its units, firewall entry, state): one per worker.
    assert [(s["unit"], s["port"], s["head"]) for s in OWN_PLAN["rpc_servers"]] == [
        ("budgetgpu-infer-chat.rpc@0.service", 8102, "node1"),
        ("budgetgpu-infer-chat.rpc@1.service", 8103, "node1"),
    ]
    # The wait before llama-server includes it; RPC nodes and a head with GPUs are as before.
    assert engines.inference_rpc_wait_command(worker, 30)[-3:] == ["node1", "127.0.0.1", "8102"]
    assert (
        inference_plan(SERVICE, HOSTVARS, "node2", list(HOSTVARS), [], head_rpc=True)["rpc_servers"]
        == (inference_plan(SERVICE, HOSTVARS, "node2", list(HOSTVARS), [])["rpc_servers"])
    )
    assert not HEAD_PLAN["rpc_servers"] and len(HEAD_PLAN["workers"][0]["rpc_servers"]) == 1


def test_the_heads_own_rpc_ports_admit_its_services_user_from_the_node_alone():
    entries = inference_firewall_ports([], [], ["monitor"], [], [OWN_PLAN])
    text = render(entries, "budgetgpu_inference", passwd={"root": ["x", "0"], "budgetgpu-infer": ["x", "998"]})
    assert rules(text) == [
        "tcp dport { 8102, 8103 } ip saddr @chat_own_rpc_servers_of_node1_v4 accept",
        "tcp dport { 8102, 8103 } ip6 saddr @chat_own_rpc_servers_of_node1_v6 accept",
        'tcp dport { 8102, 8103 } counter reject with tcp reset comment "budgetgpu: chat own RPC servers of node1, the'
        " head node1's own llama-server only\"",
        "tcp dport { 8102, 8103 } ct state new fib daddr type local meta skuid != { 0, 998 } counter reject with tcp"
        ' reset comment "budgetgpu: chat own RPC servers of node1, from this node root, budgetgpu-infer only"',
    ]
    # No host at all: loopback only.
    assert "elements" not in sets(text)["chat_own_rpc_servers_of_node1_v4"]


def test_the_heads_own_rpc_server_is_its_units_and_starts_before_its_llama_server(tmp_path, head):
    out = tmp_path / "out"
    out.mkdir()
    extra = {"test_repo": str(REPO), "test_out": str(out), "test_plan": OWN_PLAN}
    result = run_playbook(tmp_path, PLAYBOOK, extra, host="node1")
    assert result.returncode == 0, output_of(result)
    conf = directives((out / "0.conf").read_text())
    assert 'ExecStart="/usr/local/lib/budgetgpu/ggml-rpc-server" "--host" "127.0.0.1" "--port" "8102" "--cache"' in conf
    assert f"Environment=CUDA_VISIBLE_DEVICES={UUIDS[0].replace('3090', '1090')} CUDA_DEVICE_ORDER=PCI_BUS_ID" in conf
    own = run_head(tmp_path / "head", OWN_PLAN)["conf"]
    unit_section = own[own.index("[Unit]") :]
    assert "Wants=budgetgpu-infer-chat.rpc@0.service" in unit_section
    assert "After=budgetgpu-infer-chat.rpc@0.service" in unit_section
    assert "Wants=" not in head["conf"]  # a head with GPUs: its RPC servers are on other nodes
