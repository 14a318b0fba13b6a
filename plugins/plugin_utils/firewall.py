"""Who may reach a budgetgpu port (role firewall): from other hosts, the NIC addresses of the port's hosts
(net_facts, as the training table takes its members; a host without facts in this run keeps the addresses
the table's file recorded last time, and is reported stale) and the extra addresses or networks; from the
node itself, root and the local users the caller names (the socket's owner, nftables `meta skuid`), or every
local user where the caller names none; where the caller asks (local_to_hosts), those users alone also connect
from the node to the port on its hosts (the client's side, where both ends run the table). Controller side, pure
over hostvars."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.nccl import nccl_member_records, nccl_recorded_members


def host_records(
    hosts: list[str], hostvars: Mapping[str, Any], recorded: Mapping[str, Any] | None = None
) -> dict[str, dict[str, Any]]:
    """Return {host: {ipv4, ipv6, source}}: each host's addresses from its net facts (source "facts"), else
    from the table's last record (source "record": stale), else none (source None: the caller refuses it)."""
    return nccl_member_records(list(hosts or []), hostvars, None, dict(recorded or {}))


def scraper_addresses(
    hosts: list[str],
    hostvars: Mapping[str, Any],
    extra: list[str] | None = None,
    recorded: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Return {ipv4, ipv6, unknown}: every address the hosts may connect from (host_records: their NICs'
    addresses, or their last record), the extra addresses or networks as given, and the hosts known nowhere
    (the caller refuses them)."""
    found: dict[str, set[str]] = {"ipv4": set(), "ipv6": set()}
    records = host_records(hosts, hostvars, recorded)
    for record in records.values():
        for family in found:
            found[family].update(record.get(family) or [])
    for address in extra or []:
        found["ipv6" if ":" in str(address) else "ipv4"].add(str(address))
    unknown = [host for host, record in records.items() if not record["source"]]
    return {"ipv4": sorted(found["ipv4"]), "ipv6": sorted(found["ipv6"]), "unknown": unknown}


def _local_users(entry: Mapping[str, Any], passwd: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return {local, local_uids, local_unknown, local_to_hosts, client_only} of an entry: local None (every local
    user may connect, as Slurm's ports need for every user's srun) or its user names; the uids that may connect from
    the node (root's 0 first, then the users' from getent's passwd: {name: [password, uid, ...]}); names not in it;
    whether the same users only may also connect to the entry's hosts and extra addresses (local_to_hosts, which
    client_only implies: the node serves nothing on the ports, its users only connect to the hosts')."""
    names = entry.get("local")
    client_only = bool(entry.get("client_only"))
    to_hosts = bool(entry.get("local_to_hosts")) or client_only
    if names is None:
        if to_hosts:
            key = "client_only" if client_only else "local_to_hosts"
            raise ValueError(f"firewall {entry.get('what')}: {key}: found true, expected local users too")
        return {"local": None, "local_uids": None, "local_unknown": [], "local_to_hosts": False, "client_only": False}
    if isinstance(names, str) or not all(isinstance(name, str) and name for name in names):
        raise ValueError(f"firewall {entry.get('what')}: local: found {names!r}, expected a list of user names")
    # getent with a key that is not found (fail_key: false) leaves the name with None in the fact.
    users = {name: fields for name, fields in (passwd or {}).items() if fields}
    uids = sorted({int(users[name][1]) for name in names if name in users} - {0})
    unknown = [n for n in names if n not in users]
    return {
        "local": list(names),
        "local_uids": [0, *uids],
        "local_unknown": unknown,
        "local_to_hosts": to_hosts,
        "client_only": client_only,
    }


def firewall_rules(
    ports: list[Mapping[str, Any]],
    hostvars: Mapping[str, Any],
    passwd: Mapping[str, Any] | None = None,
    recorded: str | None = None,
) -> list[dict[str, Any]]:
    """Return each entry of a budgetgpu firewall table (role firewall: {port, what, only, hosts, extra,
    inputs}, optionally name, verdict and local) with ports (port as a list of "N" or "N-M", from a number,
    such a string, a comma list or a list), allow (the scraper_addresses of its hosts and extra
    addresses: {ipv4, ipv6, unknown}), records (host_records of its hosts, what the file records for the
    next run), stale (its hosts without facts whose recorded addresses are used), name (its nft sets'
    prefix, from `what` unless given), verdict (reject with a TCP reset unless given: the client learns at
    once) and the local users of _local_users (local_to_hosts: they alone also to the entry's hosts and extra
    addresses; client_only: only that, the node serves nothing on the ports). ``recorded`` is the table file's
    text of the last run."""
    previous = nccl_recorded_members(recorded)
    rules = []
    for entry in ports or []:
        port = entry["port"]
        items = port if isinstance(port, list) else str(port).split(",")
        spans = [str(item).replace(" ", "") for item in items if str(item).strip()]
        bad = [span for span in spans if not re.fullmatch(r"[0-9]+(-[0-9]+)?", span)]
        if bad or not spans:
            raise ValueError(f"firewall {entry.get('what')}: port: found {port!r}, expected ports N or ranges N-M")
        hosts = list(entry.get("hosts") or [])
        allow = scraper_addresses(hosts, hostvars, list(entry.get("extra") or []), previous)
        records = host_records(hosts, hostvars, previous)
        name = re.sub(r"[^a-z0-9]+", "_", str(entry.get("name") or entry["what"]).lower()).strip("_")
        if name in {rule["name"] for rule in rules}:
            # Two entries would declare the same nft sets: nft refuses the file.
            raise ValueError(f"firewall {entry.get('what')}: name: found {name!r} twice, expected a set name per entry")
        verdict = entry.get("verdict") or "reject with tcp reset"
        rules.append(
            {
                **entry,
                "ports": spans,
                "allow": allow,
                "records": records,
                "stale": [host for host, record in records.items() if record["source"] == "record"],
                "name": name,
                "verdict": verdict,
                **_local_users(entry, passwd),
            }
        )
    return rules


def firewall_record_lines(rules: list[Mapping[str, Any]]) -> list[str]:
    """Return the "member HOST: ADDR, ..." lines (without "# ") the table's file records for every host with
    known addresses (facts or an earlier record), once each, by host name (a caller's hosts in another order
    write the same file): what firewall_rules reads back next run for a host without facts
    (nccl_recorded_members' form)."""
    lines: dict[str, str] = {}
    for rule in rules or []:
        for host, record in (rule.get("records") or {}).items():
            addresses = list(record.get("ipv4") or []) + list(record.get("ipv6") or [])
            if record.get("source") and addresses:
                lines.setdefault(host, f"member {host}: {', '.join(addresses)}")
    return [lines[host] for host in sorted(lines)]


def firewall_stale_report(rules: list[Mapping[str, Any]], table: str) -> list[str]:
    """Return one line per host whose last recorded addresses a table uses because this run has no facts
    of it (down, or left out by --limit): the table is kept, the host is named as stale."""
    stale: dict[str, list[str]] = {}
    for rule in rules or []:
        for host in rule.get("stale") or []:
            stale.setdefault(host, []).append(str(rule.get("what")))
    return [
        f"{host}: no net facts in this run (down or left out); table {table} admits its addresses of the last run "
        f"for {', '.join(whats)} (stale: run again once it is up)"
        for host, whats in stale.items()
    ]
