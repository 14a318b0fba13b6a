"""firewall: who may reach a budgetgpu port. From other hosts: the addresses its hosts' firewall lets in
(every NIC address, the extra ones, the hosts it cannot know; a host without facts keeps its last record and
is named stale). From the node itself: root and the local users named, by uid, or every local user."""

from __future__ import annotations

import pytest
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.firewall import (
    firewall_record_lines,
    firewall_rules,
    firewall_stale_report,
    scraper_addresses,
)
from net_facts import HOSTVARS  # this folder, on the path pytest gives a test

# getent's passwd fact: {name: [password, uid, gid, gecos, home, shell]}.
PASSWD = {
    "root": ["x", "0", "0", "root", "/root", "/bin/bash"],
    "www-data": ["x", "33", "33", "www-data", "/var/www", "/usr/sbin/nologin"],
    "prometheus": ["x", "998", "997", "Prometheus daemon", "/var/lib/prometheus", "/usr/sbin/nologin"],
}


def test_scrapers_are_every_nic_address_never_docker_or_loopback_and_unknown_hosts_are_named():
    assert scraper_addresses(["node1", "control"], HOSTVARS, ["192.168.9.0/24"]) == {
        "ipv4": ["10.0.0.11", "192.168.9.0/24"],
        "ipv6": ["fd00::11"],
        "unknown": ["control"],
    }
    assert scraper_addresses([], HOSTVARS) == {"ipv4": [], "ipv6": [], "unknown": []}


def test_firewall_rules_give_each_port_its_addresses_sets_and_verdict():
    ports = [
        {"port": "9100", "what": "node exporter", "only": "Prometheus only", "hosts": ["node1"], "extra": []},
        {
            "port": 9090,
            "what": "Prometheus",
            "only": "its clients only",
            "hosts": ["control"],
            "extra": ["10.0.0.0/24"],
        },
        {"port": [29500, "60000-61000"], "what": "NCCL", "only": "members", "name": "members", "verdict": "drop"},
    ]
    rules = firewall_rules(ports, HOSTVARS)
    assert [(r["ports"], r["allow"], r["name"], r["verdict"]) for r in rules] == [
        (
            ["9100"],
            {"ipv4": ["10.0.0.11"], "ipv6": ["fd00::11"], "unknown": []},
            "node_exporter",
            "reject with tcp reset",
        ),
        (
            ["9090"],
            {"ipv4": ["10.0.0.0/24"], "ipv6": [], "unknown": ["control"]},
            "prometheus",
            "reject with tcp reset",
        ),
        (["29500", "60000-61000"], {"ipv4": [], "ipv6": [], "unknown": []}, "members", "drop"),
    ]


@pytest.mark.parametrize("port", ["", "ssh", "22;", "8100-", [], "9100,x"])
def test_firewall_rules_refuse_a_port_that_is_not_a_number_or_range(port):
    with pytest.raises(ValueError, match=r"firewall node exporter: port: found .*, expected ports N or ranges N-M"):
        firewall_rules([{"port": port, "what": "node exporter", "only": "", "hosts": [], "extra": []}], HOSTVARS)


def test_a_comma_list_of_ports_is_split():
    rule = firewall_rules([{"port": "6817, 6818,60001-60100", "what": "Slurm"}], HOSTVARS)[0]
    assert rule["ports"] == ["6817", "6818", "60001-60100"]


def test_a_port_without_local_users_admits_every_local_user_as_before():
    rule = firewall_rules([{"port": 6817, "what": "Slurm", "hosts": ["node1"]}], HOSTVARS, PASSWD)[0]
    assert (rule["local"], rule["local_uids"], rule["local_unknown"]) == (None, None, [])


def test_local_users_become_uids_with_root_first_and_unknown_names_are_listed():
    entry = {"port": 9093, "what": "Alertmanager", "hosts": [], "local": ["prometheus", "www-data", "nobody-yet"]}
    rule = firewall_rules([entry], HOSTVARS, PASSWD)[0]
    assert rule["local_uids"] == [0, 33, 998]
    assert rule["local_unknown"] == ["nobody-yet"]
    # A name getent looked up by key and did not find (fail_key: false, an earlier role's) is unknown.
    looked_up = firewall_rules([entry], HOSTVARS, {**PASSWD, "nobody-yet": None})[0]
    assert looked_up["local_uids"] == [0, 33, 998] and looked_up["local_unknown"] == ["nobody-yet"]
    # An empty list: root alone (Alertmanager's cluster port, which is off).
    off = firewall_rules([{"port": 9094, "what": "cluster", "local": []}], HOSTVARS, PASSWD)[0]
    assert off["local_uids"] == [0] and off["local_unknown"] == []


@pytest.mark.parametrize("local", ["prometheus", [""], [7]])
def test_local_users_that_are_not_a_list_of_names_are_refused(local):
    with pytest.raises(ValueError, match=r"firewall Alertmanager: local: found .*, expected a list of user names"):
        firewall_rules([{"port": 9093, "what": "Alertmanager", "local": local}], HOSTVARS, PASSWD)


def test_a_host_without_facts_keeps_its_last_recorded_addresses_and_is_reported_stale():
    entry = {"port": 9100, "what": "node exporter", "hosts": ["node1", "node2"], "extra": []}
    # node2 is down: no facts this run. Without a record it is unknown (the role stops, as before).
    first = firewall_rules([entry], HOSTVARS, PASSWD)[0]
    assert first["allow"]["unknown"] == ["node2"] and first["stale"] == []
    recorded = "# member node2: 10.0.0.12, fd00::12\n# member node1: 10.9.9.9\n"
    rule = firewall_rules([entry], HOSTVARS, PASSWD, recorded)[0]
    # node1's facts win over its old record; node2's record is used and named stale.
    assert rule["allow"] == {"ipv4": ["10.0.0.11", "10.0.0.12"], "ipv6": ["fd00::11", "fd00::12"], "unknown": []}
    assert rule["stale"] == ["node2"]
    assert firewall_stale_report([rule], "budgetgpu_metrics") == [
        "node2: no net facts in this run (down or left out); table budgetgpu_metrics admits its addresses of the "
        "last run for node exporter (stale: run again once it is up)"
    ]


def test_the_file_records_each_hosts_addresses_once_for_the_next_run():
    entries = [
        {"port": 9100, "what": "node exporter", "hosts": ["node1", "control"]},
        {"port": 9090, "what": "Prometheus", "hosts": ["node1", "node6"]},
    ]
    rules = firewall_rules(entries, HOSTVARS, PASSWD, "# member node9: 10.0.0.19\n")
    assert firewall_record_lines(rules) == ["member node1: 10.0.0.11, fd00::11", "member node6: fd00::16"]
    # The hosts in another order (a caller's set) write the same lines.
    entries_reversed = [{**entry, "hosts": entry["hosts"][::-1]} for entry in entries[::-1]]
    assert firewall_record_lines(firewall_rules(entries_reversed, HOSTVARS, PASSWD)) == firewall_record_lines(rules)
    # A record kept for a host still without facts is written again, so that it survives another run.
    kept = firewall_rules(
        [{"port": 9100, "what": "x", "hosts": ["node9"]}], HOSTVARS, PASSWD, "# member node9: 10.0.0.19"
    )
    assert firewall_record_lines(kept) == ["member node9: 10.0.0.19"]
