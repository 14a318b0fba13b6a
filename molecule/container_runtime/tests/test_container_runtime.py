"""container_runtime: outcomes on the nodes.

node1 runs Debian's real docker.io: daemon.json merged (the user's keys kept), live-restore on,
the daemon not restarted by the idempotence run, the docker group as listed. node2 has docker-ce
from the local signed repository of dummy packages: repository, keyring, pins and holds.
Both have the (dummy) NVIDIA container toolkit from the local repository, pinned.
"""

from __future__ import annotations

import json
import os

import pytest
import testinfra.utils.ansible_runner

RUNNER = testinfra.utils.ansible_runner.AnsibleRunner(os.environ["MOLECULE_INVENTORY_FILE"])
testinfra_hosts = RUNNER.get_hosts("gpu_nodes")

NODE1 = "container_runtime-node1"
NODE2 = "container_runtime-node2"


def daemon_json(host) -> dict:
    return json.loads(host.file("/etc/docker/daemon.json").content_string)


def test_daemon_json_keeps_the_users_keys_and_has_the_managed_ones(host):
    config = daemon_json(host)
    assert config["log-level"] == "warn"  # the user's key
    assert config["runtimes"]["plain-runc"] == {"path": "/usr/sbin/runc"}  # the user's, beside nvidia
    assert config["runtimes"]["nvidia"] == {"path": "nvidia-container-runtime", "args": []}
    assert config["live-restore"] is True
    assert config["storage-driver"] == "vfs"
    assert config["log-opts"] == {"max-size": "10m"}
    assert "default-runtime" not in config
    daemon = host.file("/etc/docker/daemon.json")
    assert (daemon.user, daemon.group, daemon.mode) == ("root", "root", 0o644)


def test_toolkit_repository_is_signed_by_its_own_keyring(host):
    source = host.file("/etc/apt/sources.list.d/nvidia-container-toolkit.sources").content_string
    assert "URIs: http://aptrepo:8080/libnvidia-container/stable/deb/amd64" in source
    assert "Suites: /" in source
    assert "Signed-By: /etc/apt/keyrings/nvidia-container-toolkit.asc" in source
    assert "BEGIN PGP PUBLIC KEY BLOCK" in host.file("/etc/apt/keyrings/nvidia-container-toolkit.asc").content_string
    assert not host.file("/etc/apt/trusted.gpg").exists


def test_toolkit_is_pinned_held_and_the_older_release_wins(host):
    pin = host.file("/etc/apt/preferences.d/budgetgpu-nvidia-container-toolkit").content_string
    assert "Pin: version 1.17.8-1" in pin and "Pin-Priority: 1001" in pin
    for package in ("nvidia-container-toolkit", "nvidia-container-toolkit-base", "libnvidia-container-tools"):
        assert host.package(package).version == "1.17.8-1", package
        assert "1.18.0-1" in host.check_output(f"apt-cache policy {package}")  # the newer one is served
    held = host.check_output("apt-mark showhold").split()
    assert "nvidia-container-toolkit" in held
    assert host.file("/usr/bin/nvidia-container-runtime").is_file


def test_docker_daemon_runs(host):
    assert host.service("docker").is_running
    assert host.service("docker").is_enabled


@pytest.mark.parametrize("node", [NODE1])
def test_live_restore_is_on_in_the_running_daemon(host, node):
    if host.backend.host != node:
        pytest.skip("real daemon on node1 only")
    assert host.check_output("docker info --format '{{.LiveRestoreEnabled}} {{.Driver}}'") == "true vfs"
    runtimes = host.check_output("docker info --format '{{json .Runtimes}}'")
    assert "nvidia" in json.loads(runtimes)


def test_idempotence_run_left_the_daemon_alone(host):
    runs = host.file("/root/docker-daemon-runs").content_string.splitlines()
    assert len(runs) == 2, runs  # converge, idempotence
    assert runs[0] == runs[1], runs
    assert "MainPID=0" not in runs[0]
    pid = host.check_output("systemctl show -p MainPID --value docker.service")
    assert f"MainPID={pid}" in runs[0]


def test_docker_group_holds_only_the_listed_users(host):
    members = host.check_output("getent group docker").split(":")[3]
    expected = {"trainer"} if host.backend.host == NODE1 else set()
    assert set(filter(None, members.split(","))) == expected
    assert "docker" not in host.user("bystander").groups


def test_distribution_node_has_debians_engine_and_no_docker_repository(host):
    if host.backend.host != NODE1:
        pytest.skip("node1 only")
    assert host.package("docker.io").is_installed
    assert not host.package("docker-ce").is_installed
    assert not host.file("/etc/apt/sources.list.d/docker.sources").exists
    assert not host.file("/etc/apt/preferences.d/budgetgpu-docker").exists
    assert "docker.io" in host.check_output("apt-mark showhold").split()


def test_docker_node_has_docker_ce_from_the_signed_repository_pinned_and_held(host):
    if host.backend.host != NODE2:
        pytest.skip("node2 only")
    source = host.file("/etc/apt/sources.list.d/docker.sources").content_string
    assert "URIs: http://aptrepo:8080/linux/debian" in source
    assert "Suites: bookworm" in source and "Components: stable" in source
    assert "Signed-By: /etc/apt/keyrings/docker.asc" in source
    pin = host.file("/etc/apt/preferences.d/budgetgpu-docker").content_string
    assert "Package: docker-ce docker-ce-cli" in pin
    assert "Pin: version 5:28.3.3-1~debian.12~bookworm" in pin
    for package in ("docker-ce", "docker-ce-cli"):
        assert host.package(package).version == "5:28.3.3-1~debian.12~bookworm"
    assert "5:28.4.0-1~debian.12~bookworm" in host.check_output("apt-cache policy docker-ce")
    assert host.package("containerd.io").is_installed
    assert not host.package("docker.io").is_installed
    held = set(host.check_output("apt-mark showhold").split())
    assert {"docker-ce", "docker-ce-cli", "containerd.io", "nvidia-container-toolkit"} <= held


# Last: it restarts the daemon (the PID test above reads the runs recorded by converge).
def test_a_running_container_survives_a_daemon_restart(host):
    if host.backend.host != NODE1:
        pytest.skip("real daemon on node1 only")
    # No registry is reachable: an image of /bin/sleep and its libraries, from the node itself.
    host.check_output(
        "cd / && tar -ch bin/sleep lib/x86_64-linux-gnu/libc.so.6 lib64/ld-linux-x86-64.so.2"
        " | docker import - budgetgpu/sleeper:test"
    )
    host.run("docker rm -f live-restore-probe")
    host.check_output(
        "docker run -d --network none --runtime nvidia --name live-restore-probe budgetgpu/sleeper:test"
        " /bin/sleep infinity"
    )
    try:
        before = host.check_output("docker inspect -f '{{.State.Status}} {{.State.Pid}}' live-restore-probe")
        assert before.startswith("running ")
        host.check_output("systemctl restart docker.service")
        after = host.check_output("docker inspect -f '{{.State.Status}} {{.State.Pid}}' live-restore-probe")
        assert after == before
    finally:
        host.run("docker rm -f live-restore-probe")
