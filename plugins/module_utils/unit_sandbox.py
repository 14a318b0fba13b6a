"""The sandbox of every unit that runs users' code on the GPUs: the training jobs (role torchrun) and
the inference workers (role inference) render it through the ``unit_hardening`` filter, and
``roles/probe/files/gpu-smoke --sandbox`` rebuilds it on a node without Ansible. Stdlib only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# No PrivateDevices (it would hide the GPUs) and no MemoryDenyWriteExecute (CUDA and torch JIT).
UNIT_HARDENING_ALWAYS = {
    "NoNewPrivileges": "yes",
    "RestrictSUIDSGID": "yes",
    "RestrictRealtime": "yes",
    "LockPersonality": "yes",
    "RestrictNamespaces": "yes",
    "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6 AF_NETLINK",
    "CapabilityBoundingSet": "",
    "AmbientCapabilities": "",
    "SystemCallArchitectures": "native",
    "DevicePolicy": "closed",
    "UMask": "0027",
}
# The part that needs mount namespaces (a container without them runs jobs with sandbox off).
UNIT_HARDENING_SANDBOX = {
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "ProtectClock": "yes",
    "ProtectHostname": "yes",
}


def unit_hardening(sandbox: bool, overrides: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Return a unit's hardening directives: always, the sandbox part if asked, then overrides."""
    directives = dict(UNIT_HARDENING_ALWAYS)
    if sandbox:
        directives.update(UNIT_HARDENING_SANDBOX)
    directives.update({str(k): str(v) for k, v in (overrides or {}).items()})
    return directives
