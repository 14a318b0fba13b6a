"""Role container_runtime's input check: every problem of its inputs on one node, each naming the host
and the variable. Controller-side and pure (values in, messages out)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_URL = re.compile(r"https?://[^/]+")


def container_runtime_problems(inputs: Mapping[str, Any]) -> list[str]:
    """Return the problems of inputs: host, os_family, distribution, version, source (docker or distro),
    nvidia_toolkit, the URLs the node will fetch (docker_repo_url, docker_key_url: Docker's repository,
    only with source docker; nvidia_toolkit_repo_url, nvidia_toolkit_key_url: only with nvidia_toolkit),
    users (to add to the docker group), passwd_users (the node's), daemon_json (what
    /etc/docker/daemon.json holds now)."""
    host = inputs.get("host")
    problems = []
    if inputs.get("os_family") != "Debian":
        problems.append(
            f"{host}: container_runtime supports Debian and Ubuntu, found {inputs.get('distribution')} "
            f"{inputs.get('version')}"
        )
    urls = {}
    if inputs.get("source") == "docker":
        urls |= {name: inputs.get(name) for name in ("docker_repo_url", "docker_key_url")}
    if inputs.get("nvidia_toolkit"):
        urls |= {name: inputs.get(name) for name in ("nvidia_toolkit_repo_url", "nvidia_toolkit_key_url")}
    problems += [
        f"{host}: container_runtime_{name} is '{url}', expected an http:// or https:// URL"
        for name, url in urls.items()
        if not _URL.match(str(url))
    ]
    known = set(inputs.get("passwd_users") or [])
    missing = [user for user in inputs.get("users") or [] if user not in known]
    if missing:
        problems.append(
            f"{host}: container_runtime_users names {', '.join(missing)}, not a user on this node: create them first "
            "(python_env creates the training user) or remove them"
        )
    current = inputs.get("daemon_json")
    if not isinstance(current, Mapping):
        problems.append(f"{host}: /etc/docker/daemon.json holds {type(current).__name__}, expected a JSON object")
    return problems
