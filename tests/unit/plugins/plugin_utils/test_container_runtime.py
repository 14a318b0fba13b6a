"""container_runtime's input check: every problem named with host and variable, each URL only where the
node would fetch it."""

from __future__ import annotations

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.container_runtime import container_runtime_problems

GOOD = {
    "host": "node1",
    "os_family": "Debian",
    "distribution": "Ubuntu",
    "version": "24.04",
    "source": "docker",
    "nvidia_toolkit": True,
    "docker_repo_url": "https://download.docker.com/linux/ubuntu",
    "docker_key_url": "https://download.docker.com/linux/ubuntu/gpg",
    "nvidia_toolkit_repo_url": "https://nvidia.github.io/libnvidia-container/stable/deb",
    "nvidia_toolkit_key_url": "https://nvidia.github.io/libnvidia-container/gpgkey",
    "users": ["budgetgpu"],
    "passwd_users": ["root", "budgetgpu"],
    "daemon_json": {"log-driver": "journald"},
}


def test_inputs_that_fit_have_no_problem():
    assert container_runtime_problems(GOOD) == []
    # Distro packages and no toolkit: the URLs are not fetched, so not checked.
    assert (
        container_runtime_problems({**GOOD, "source": "distro", "nvidia_toolkit": False, "docker_repo_url": "x"}) == []
    )


def test_every_problem_names_host_and_variable():
    bad = {
        **GOOD,
        "os_family": "RedHat",
        "distribution": "Rocky",
        "version": "9.4",
        "docker_key_url": "download.docker.com/gpg",
        "nvidia_toolkit_repo_url": "ftp://mirror/deb",
        "users": ["budgetgpu", "alice", "bob"],
        "daemon_json": ["log-driver"],
    }
    assert container_runtime_problems(bad) == [
        "node1: container_runtime supports Debian and Ubuntu, found Rocky 9.4",
        "node1: container_runtime_docker_key_url is 'download.docker.com/gpg', expected an http:// or https:// URL",
        "node1: container_runtime_nvidia_toolkit_repo_url is 'ftp://mirror/deb', expected an http:// or https:// URL",
        "node1: container_runtime_users names alice, bob, not a user on this node: create them first (python_env"
        " creates the training user) or remove them",
        "node1: /etc/docker/daemon.json holds list, expected a JSON object",
    ]
