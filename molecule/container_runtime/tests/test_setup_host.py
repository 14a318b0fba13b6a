"""scripts/setup-host on a node that had no Docker engine (container_runtime-host).

converge ran it first as `nobody` (recorded in /root/setup-host-user.out), then as root after a
killed dockerd's pid file was left in /run, then again as root in the idempotence run (both root
runs' output in /root/setup-host-runs.out). The node boots systemd, as a stock Debian 12 does.
"""

from __future__ import annotations

import os

import testinfra.utils.ansible_runner

RUNNER = testinfra.utils.ansible_runner.AnsibleRunner(os.environ["MOLECULE_INVENTORY_FILE"])
testinfra_hosts = RUNNER.get_hosts("setup_host")

SCRIPT = "/opt/checkout/scripts/setup-host"


def test_not_root_it_names_what_is_missing_and_the_one_command(host):
    rc, *lines = host.file("/root/setup-host-user.out").content_string.splitlines()
    assert rc == "rc=1", lines
    assert lines == [
        f"setup-host: docker.io debootstrap missing; setting this machine up needs root. Run: sudo {SCRIPT}"
    ]


def test_as_root_it_removed_the_stale_pid_file_installed_and_started_the_engine(host):
    runs = host.file("/root/setup-host-runs.out").content_string.splitlines()
    first, second = runs[:-1], runs[-1:]
    assert first[:2] == [
        "setup-host: removed the stale /var/run/docker.pid (its process is gone)",
        "setup-host: installing docker.io debootstrap from the distribution (apt-get)",
    ], runs
    # Debian's package starts the engine under systemd as it installs; else the script starts it.
    assert set(first[2:-1]) <= {"setup-host: starting dockerd (systemctl start docker)"}, runs
    assert first[-1].startswith("setup-host: dockerd answers (Docker "), runs
    assert first[-1].endswith(", storage driver vfs)"), runs
    assert second == ["setup-host: docker.io and debootstrap installed, dockerd answers: nothing to do"], runs


def test_the_engine_answers_on_vfs_and_debootstrap_is_there(host):
    # Overlay on the node's own overlay root is refused: the engine must have fallen back to vfs.
    assert host.check_output("docker info --format '{{.Driver}}'") == "vfs"
    assert host.package("docker.io").is_installed
    assert host.package("debootstrap").is_installed
    pid = host.file("/run/docker.pid").content_string.strip()
    assert host.check_output("systemctl show -p MainPID --value docker.service") == pid
