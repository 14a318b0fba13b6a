"""What the scenarios' tests share: a playbook of the checkout run against the scenario's nodes, and a node's
reboot (pytest loads this file for every scenario's tests: the rootdir is the checkout, where pyproject.toml is)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest


def run_playbook(name: str, *args: str, **env_extra: str) -> subprocess.CompletedProcess:
    """Run playbooks/<name> as a user (or the nightly run) would. The result's stdout holds the words of
    both streams, whitespace made single spaces: failures go to stderr (molecule's ansible.cfg, which
    the verifier's environment names, sets display_failed_stderr), and the callback wraps long
    messages (a literal \\n in their quoted form)."""
    repo = Path(os.environ["MOLECULE_PROJECT_DIRECTORY"])
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0", **env_extra}
    argv = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", os.environ["MOLECULE_INVENTORY_FILE"]]
    argv += [str(repo / "playbooks" / name), *args]
    done = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=300, check=False)
    words = " ".join((done.stdout + done.stderr).replace("\\n", " ").split())
    return subprocess.CompletedProcess(argv, done.returncode, words, done.stderr)


@pytest.fixture(name="playbook")
def fixture_playbook():
    """run_playbook, for the tests."""
    return run_playbook


# systemd's halt signal. docker stops a container with SIGTERM, which systemd as PID 1 takes as "re-execute
# yourself": `docker restart` would wait its 10 s and SIGKILL every process, a power cut. A halt stops the units in
# order as `reboot` does, then systemd exits and the container with it (the engine here, API 1.41, has no
# `docker restart --signal`).
HALT = "SIGRTMIN+3"
# "degraded" still means booted: a unit that cannot run in a container failed.
BOOTED = ("running", "degraded")


def docker(*argv: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *argv], capture_output=True, text=True, timeout=timeout, check=False)


def addresses(name: str) -> dict[str, str]:
    """The container's address on each of its networks."""
    shown = docker("inspect", "-f", "{{json .NetworkSettings.Networks}}", name, timeout=60)
    return {net: about["IPAddress"] for net, about in json.loads(shown.stdout or "{}").items()}


def reboot_node(node, timeout: float = 180) -> None:
    """Reboot a node container (a testinfra host or its name): systemd halts it, the container starts again
    and systemd boots as PID 1 (units wanted by multi-user.target start, the tmpfs /run and /tmp come back
    empty, the network namespace and its nftables rules are new, timers start over; the kernel, the disk and
    the journal stay). Returns when systemd says running or degraded and the node answers again; fails
    naming the node and what it said after `timeout` seconds per phase. testinfra's docker backend runs a
    `docker exec` per command: no connection to renew."""
    name = node if isinstance(node, str) else node.backend.get_hostname()
    before = addresses(name)
    # What every reboot empties: proof that this one was one.
    marked = docker("exec", name, "touch", "/run/budgetgpu-before-reboot", timeout=60)
    assert marked.returncode == 0, f"{name}: not running before its reboot: {marked.stderr.strip()}"
    halted = docker("kill", "--signal", HALT, name, timeout=60)
    assert halted.returncode == 0, f"{name}: docker kill --signal {HALT} failed: {halted.stderr.strip()}"
    try:
        docker("wait", name, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name}: still running {timeout:.0f} s after systemd was told to halt: a unit does not stop")
    started = docker("start", name, timeout=60)
    assert started.returncode == 0, f"{name}: docker start failed: {started.stderr.strip()}"
    deadline = time.monotonic() + timeout
    said = ""
    while said not in BOOTED and time.monotonic() < deadline:
        time.sleep(1)
        # Right after the start systemd may not answer on its bus yet ("Failed to connect to bus").
        with contextlib.suppress(subprocess.TimeoutExpired):
            done = docker("exec", name, "systemctl", "is-system-running", "--wait", timeout=deadline - time.monotonic())
            said = done.stdout.strip() or done.stderr.strip()
    if said not in BOOTED:
        pytest.fail(f"{name}: not booted {timeout:.0f} s after its restart: systemctl is-system-running said {said!r}")
    assert docker("exec", name, "test", "-e", "/run/budgetgpu-before-reboot", timeout=60).returncode == 1, (
        f"{name}: /run survived the restart: not a boot"
    )
    # A real node keeps its address (static, or a DHCP reservation); Docker hands out the lowest free one.
    assert addresses(name) == before, f"{name}: came back at {addresses(name)}, was at {before}"
    if not isinstance(node, str):
        node.check_output("true")


@pytest.fixture(name="reboot")
def fixture_reboot():
    """reboot_node, for the tests: `reboot(host)` or `reboot("node-name")`."""
    return reboot_node
