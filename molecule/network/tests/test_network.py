"""NCCL network on a container cluster: the interface and reason per node, the override, the
members-only firewall, and the communication test's report (and its failure under a high floor)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import testinfra

NODES = ("network-node1", "network-node2", "network-node3")
OUTSIDER = "network-outsider"
NETWORK = "budgetgpu-molecule-network"
NETWORK_B = "budgetgpu-molecule-network-b"
ENV_FILE = "/etc/budgetgpu/nccl.env"
REPORT = Path(os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY", "/nonexistent")) / "comm-test" / "comm-test.json"
SCENARIO = Path(__file__).resolve().parents[1]
# What the probes find: node1 one H200, node2 four GeForce 3090 on root ports, node3 3090 + 4090.
P2P = {"network-node1": None, "network-node2": "1", "network-node3": "1"}


def node(name: str) -> testinfra.host.Host:
    return testinfra.get_host(f"docker://{name}")


def docker_address(container: str, network: str) -> str:
    out = subprocess.check_output(
        ["docker", "inspect", "-f", f'{{{{(index .NetworkSettings.Networks "{network}").IPAddress}}}}', container],
        text=True,
    )
    return out.strip()


def interface_of(name: str, address: str) -> str:
    """Return the container's interface holding address (eth0/eth1 order is Docker's to choose)."""
    for line in node(name).check_output("ip -o -4 addr show").splitlines():
        fields = line.split()
        if fields[3].split("/")[0] == address:
            return fields[1].split("@")[0]
    raise AssertionError(f"{name}: no interface holds {address}")


def env_of(name: str) -> dict[str, str]:
    text = node(name).file(ENV_FILE).content_string
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def nccl_address(name: str) -> str:
    return docker_address(name, NETWORK_B if name == "network-node3" else NETWORK)


@pytest.mark.parametrize("name", NODES)
def test_env_file_names_the_cluster_interface_and_transport(name: str) -> None:
    expected = interface_of(name, nccl_address(name))
    env = env_of(name)
    assert env["NCCL_SOCKET_IFNAME"] == f"={expected}"
    assert env["GLOO_SOCKET_IFNAME"] == expected
    assert env["NCCL_IB_DISABLE"] == "1"
    assert env["NCCL_NET"] == "Socket"
    assert env.get("NCCL_P2P_DISABLE") == P2P[name]
    file = node(name).file(ENV_FILE)
    assert file.mode == 0o644 and file.user == "root"
    assert "Ansible managed" in file.content_string


def test_bridge_with_a_cluster_address_is_passed_over() -> None:
    text = node("network-node1").file(ENV_FILE).content_string
    assert "passed over br0 (bridge)" in text
    assert "veth: this node is a container" in text


def test_inventory_override_wins_for_node3() -> None:
    text = node("network-node3").file(ENV_FILE).content_string
    assert "set by inventory (budgetgpu_cluster_interface=eth1)" in text
    assert (
        interface_of("network-node3", docker_address("network-node3", NETWORK))
        not in env_of("network-node3")["NCCL_SOCKET_IFNAME"]
    )


def test_p2p_reasons_come_from_the_probes() -> None:
    assert "GeForce RTX 3090 across PCIe root ports" in node("network-node2").file(ENV_FILE).content_string
    assert "mixed GPU models" in node("network-node3").file(ENV_FILE).content_string
    assert "P2P unset: one GPU" in node("network-node1").file(ENV_FILE).content_string


@pytest.mark.parametrize("name", NODES)
def test_firewall_table_admits_members_only(name: str) -> None:
    table = node(name).check_output("nft list table inet budgetgpu")
    for member in NODES:
        assert docker_address(member, NETWORK) in table
    assert docker_address(OUTSIDER, NETWORK) not in table
    assert "29500" in table and "drop" in table
    assert node(name).service("budgetgpu-firewall").is_enabled


def connects(source: str, address: str, port: int) -> bool:
    script = f"import socket; socket.create_connection(('{address}', {port}), timeout=3).close()"
    return node(source).run(f'python3 -c "{script}"').rc == 0


def test_outsider_cannot_reach_the_rendezvous_port_members_can() -> None:
    master = node("network-node1")
    address = docker_address("network-node1", NETWORK)
    listener = (
        "import socket,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
        f"s.bind(('{address}', 29500)); s.listen(8); s.settimeout(30); [s.accept()[0].close() for _ in range(8)]"
    )
    master.run("systemctl stop budgetgpu-test-listener 2>/dev/null; true")
    master.check_output(f'systemd-run --unit=budgetgpu-test-listener --collect timeout 40 python3 -c "{listener}"')
    try:
        for _unused in range(50):
            if master.socket(f"tcp://{address}:29500").is_listening:
                break
            time.sleep(0.1)
        assert connects("network-node2", address, 29500), "a member cannot reach the rendezvous port"
        assert connects("network-node3", address, 29500), "a member cannot reach the rendezvous port"
        assert not connects(OUTSIDER, address, 29500), "the outsider reached the rendezvous port"
        # SSH stays open to everyone: only the job ports close.
        assert connects(OUTSIDER, address, 22), "the firewall closed SSH"
    finally:
        master.run("systemctl stop budgetgpu-test-listener")


def test_comm_test_report_is_consistent_with_iperf3() -> None:
    report = json.loads(REPORT.read_text())
    assert report["passed"], report["failures"]
    assert report["backend"] == "gloo" and report["world_size"] == 3
    sizes = [row["bytes"] for row in report["rows"]]
    assert sizes[0] == 1024 and sizes[-1] >= 64 << 20
    assert all(row["wrong"] == 0 for row in report["rows"])
    assert len(report["iperf3"]) == 3 and all(p["gbs"] > 0 for p in report["iperf3"])
    assert len(report["pairs"]) == 3
    # Over the same wire, a ring all-reduce's bus bandwidth cannot beat raw TCP by much.
    assert 0 < report["large_busbw_gbs"] <= 1.5 * report["iperf3_min_gbs"]
    assert (REPORT.parent / "comm-test.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_floor_above_the_network_fails_naming_the_slowest_pair() -> None:
    env = dict(os.environ)
    env["ANSIBLE_CONFIG"] = str(Path(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"]) / "ansible.cfg")
    env["ANSIBLE_INJECT_FACT_VARS"] = "false"
    env["ANSIBLE_NOCOLOR"] = "1"
    run = subprocess.run(
        [
            "ansible-playbook",
            "-i",
            os.environ["MOLECULE_INVENTORY_FILE"],
            str(SCENARIO / "comm_test.yml"),
            "-e",
            "nccl_network_busbw_floor_gbps=1000",
            "-e",
            f"nccl_network_report_dir={REPORT.parent}/high-floor",
            # The floor judges the largest size only: a shorter sweep keeps this second run quick.
            "-e",
            "nccl_network_comm_test_min_bytes=16777216",
            "-e",
            "nccl_network_comm_test_iters=2",
            "-e",
            "nccl_network_iperf_duration=1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=400,
        check=False,
    )
    assert run.returncode != 0, run.stdout[-3000:]
    # The callback wraps long lines: compare with the whitespace folded.
    output = " ".join((run.stdout + run.stderr).split())
    assert "is under the floor 1000.000 GB/s" in output, run.stdout[-3000:]
    assert "slowest pair network-node" in output, run.stdout[-3000:]
    report = json.loads((REPORT.parent / "high-floor" / "comm-test.json").read_text())
    assert not report["passed"]
    slowest = report["slowest_pair"]
    assert f"slowest pair {slowest['src']} -> {slowest['dst']}" in report["failures"][0]


@pytest.mark.parametrize("name", NODES)
def test_the_comm_test_kills_no_pid_its_user_planted(name: str) -> None:
    """The side effect's planter wrote a root process's pid into the test user's iperf3.pid for the whole
    test: the release before killed that process as root. Now the servers are a unit root stops by name."""
    host = node(name)
    try:
        assert host.run("systemctl is-active budgetgpu-test-planter.service").stdout.strip() == "active"
        pid = host.check_output("systemctl show -p MainPID --value budgetgpu-test-victim.service")
        assert host.run("systemctl is-active budgetgpu-test-victim.service").stdout.strip() == "active"
        assert host.check_output("cat /var/lib/budgetgpu/comm-test/iperf3.pid") == pid  # still planted
        assert host.run("pgrep -x iperf3").rc == 1, "an iperf3 server outlived the test"
        assert host.run("systemctl is-active budgetgpu-comm-iperf3.service").stdout.strip() != "active"
    finally:
        host.run("systemctl stop budgetgpu-test-planter.service budgetgpu-test-victim.service")
