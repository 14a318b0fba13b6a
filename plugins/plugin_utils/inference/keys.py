"""The gateway's API keys (inference_api_keys): checked, and the ones each service accepts. A problem
never shows a key."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.services import (
    SERVICE_DEFAULTS,
    _as_int,
    _is_int,
)

# An API key as NGINX compares it (a regular expression of the whole Authorization header, so that
# case counts): characters that need no quoting, long enough not to be guessed.
API_KEY_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


API_KEY = re.compile(r"^[A-Za-z0-9._~+/=-]{24,256}$")


def _key_entries(api_keys: Any) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Return ({name: {key, rate_per_s}}, problems) of inference_api_keys. A problem never shows a key."""
    if api_keys in (None, ""):
        return {}, []
    if not isinstance(api_keys, Mapping):
        return {}, [f"inference_api_keys: found {type(api_keys).__name__}, expected a mapping of key name -> key"]
    entries, problems = {}, []
    for name, value in api_keys.items():
        where = f"inference_api_keys.{name}"
        if not isinstance(name, str) or not API_KEY_NAME.fullmatch(name):
            problems.append(f"{where}: name: expected 1 to 64 of A-Z a-z 0-9 _ . -")
            continue
        entry = dict(value) if isinstance(value, Mapping) else {"key": value}
        key, rate = entry.get("key"), _as_int(entry.get("rate_per_s"))
        if set(entry) - {"key", "rate_per_s"}:
            problems.append(
                f"{where}: found keys {', '.join(sorted(map(str, set(entry) - {'key', 'rate_per_s'})))}, "
                "expected key and rate_per_s only"
            )
        if not isinstance(key, str) or not API_KEY.fullmatch(key):
            size = len(key) if isinstance(key, str) else type(key).__name__
            problems.append(
                f"{where}: found a key of {size} characters (not shown), expected 24 to 256 of "
                "A-Z a-z 0-9 . _ ~ + / = - (e.g. openssl rand -hex 24)"
            )
        if rate is not None and (not _is_int(rate) or rate < 1):
            problems.append(f"{where}: rate_per_s: found {rate!r}, expected a whole number of 1 or more")
        entries[name] = {"key": key, "rate_per_s": rate}
    return entries, problems


def _service_keys(service: Mapping[str, Any], entries: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """Return (the key names the service's gateway accepts, problems)."""
    name, wanted = service.get("name"), (service.get("gateway") or {}).get("keys")
    if wanted is None:
        names = sorted(entries)
    else:
        names = [k for k in wanted if k in entries]
        unknown = [k for k in wanted if k not in entries]
        if unknown:
            return names, [
                f"all: service {name}: gateway.keys: found {', '.join(map(str, unknown))}, expected names of "
                f"inference_api_keys ({', '.join(sorted(entries)) or 'none'})"
            ]
    if not names:
        return [], [
            f"all: service {name}: gateway: found no API key, expected at least one in inference_api_keys "
            "(a mapping of name -> key; keep it in Ansible Vault): the gateway refuses every request without one"
        ]
    return names, []


def inference_gateway_keys(service: Mapping[str, Any], api_keys: Any) -> list[dict[str, Any]]:
    """Return the keys the service's gateway accepts, for its NGINX key map: [{name, pattern, rate_per_s}]
    (pattern: a case-sensitive regular expression of the whole Authorization header). Secret: render
    it only in a no_log task. Raises ValueError (without the keys) on the problems preflight reports."""
    entries, problems = _key_entries(api_keys)
    names, more = _service_keys(service, entries)
    if problems or more:
        raise ValueError("; ".join(problems + more))
    rate = (service.get("gateway") or {}).get("rate_per_s") or SERVICE_DEFAULTS["gateway"]["rate_per_s"]
    return [
        {
            "name": name,
            "pattern": "^Bearer " + re.escape(entries[name]["key"]) + "$",
            "rate_per_s": entries[name]["rate_per_s"] or rate,
        }
        for name in names
    ]
