"""Role _firewall, the one nftables mechanism of the collection: each caller's ports (the training table of
nccl_network, inference's workers and gateways, Slurm's daemons, the exporters) admit their hosts and
refuse everyone else, in a table of the caller's own. The template is rendered with the inputs the
callers compute (filters firewall_rules, inference_firewall_ports, nccl_network_plan)."""

from __future__ import annotations

import re
from pathlib import Path

import jinja2
import pytest
import yaml
from ansible_collections.budgetgpu.cluster.plugins.filter.nccl import nccl_network_plan
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.firewall import firewall_record_lines, firewall_rules
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.inference.gateway import inference_firewall_ports
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.nccl import nccl_member_lines, nccl_recorded_members

ROLES = Path(__file__).resolve().parents[3] / "roles"
TEMPLATE = ROLES / "_firewall/templates/budgetgpu.nft.j2"
CALLERS = ("nccl_network", "inference", "slurm", "node_exporter", "prometheus", "alertmanager")


def net(*addresses: str) -> dict:
    nic = {"name": "eth0", "kind": "physical", "addresses": [{"address": a, "prefix": 24} for a in addresses]}
    return {"ansible_facts": {"budgetgpu_net": {"interfaces": [nic], "cluster_interface": None}}}


HOSTVARS = {"monitor": net("10.0.0.13", "fd00::13"), "node1": net("10.0.0.11")}


def render(
    entries: list[dict],
    table: str = "budgetgpu_test",
    notes: list[str] | None = None,
    passwd: dict | None = None,
    recorded: str | None = None,
) -> str:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    env.filters["comment"] = lambda text: "# " + text
    env.filters["budgetgpu.cluster.firewall_record_lines"] = firewall_record_lines
    env.tests["search"] = lambda value, pattern: re.search(pattern, str(value)) is not None
    return env.from_string(TEMPLATE.read_text()).render(
        ansible_managed="Ansible managed",
        _firewall_rules=firewall_rules(entries, HOSTVARS, passwd, recorded),
        _firewall_table=table,
        _firewall_notes=notes or [],
    )


def rules(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("tcp dport")]


def sets(text: str) -> dict[str, str]:
    """{set name: its body}."""
    return dict(re.findall(r"\tset (\w+) \{\n(.*?)\n\t\}", text, re.S))


def test_a_port_admits_its_hosts_nic_addresses_and_refuses_the_rest_with_a_reset():
    entry = {"port": 9100, "what": "node exporter", "only": "Prometheus only", "hosts": ["monitor"], "extra": []}
    text = render([entry], "budgetgpu_metrics")
    assert "table inet budgetgpu_metrics {" in text and "delete table inet budgetgpu_metrics" in text
    assert rules(text) == [
        "tcp dport { 9100 } ip saddr @node_exporter_v4 accept",
        "tcp dport { 9100 } ip6 saddr @node_exporter_v6 accept",
        'tcp dport { 9100 } counter reject with tcp reset comment "budgetgpu: node exporter, Prometheus only"',
    ]
    assert "elements = { 10.0.0.13 }" in sets(text)["node_exporter_v4"]
    assert "elements = { fd00::13 }" in sets(text)["node_exporter_v6"]
    # Plain addresses need no interval set.
    assert "interval" not in text


def test_a_port_without_clients_is_loopback_only():
    text = render([{"port": 9090, "what": "Prometheus", "only": "its clients only", "hosts": [], "extra": []}])
    assert "elements" not in sets(text)["prometheus_v4"]
    assert 'iifname "lo" accept' in text and "#   9090 (Prometheus): loopback only" in text


def test_networks_make_an_interval_set_that_merges_a_member_inside_one():
    entry = {"port": "6817-6818", "what": "Slurm", "only": "cluster", "hosts": ["node1"], "extra": ["10.0.0.0/24"]}
    body = sets(render([entry]))["slurm_v4"]
    assert "flags interval" in body and "auto-merge" in body
    assert "elements = { 10.0.0.0/24, 10.0.0.11 }" in body
    assert "interval" not in sets(render([entry]))["slurm_v6"]


def test_inference_workers_admit_gateway_and_prometheus_each_port_exactly_and_an_empty_allow_list_no_one():
    plan = [
        {
            "name": "chat",
            "state": "started",
            "gateway_address": "10.0.0.11",
            "workers": [{"port": 8102}, {"port": 8100}],
        },
        {"name": "old", "state": "absent", "gateway_address": "10.0.0.11", "workers": [{"port": 8101}]},
    ]
    gateways = [
        {"name": "chat", "state": "started", "gateway_port": 8080, "allow": ["10.0.0.0/24", "fd00::/64"]},
        {"name": "embed", "state": "started", "gateway_port": 8081, "allow": []},
    ]
    text = render(inference_firewall_ports(plan, gateways, ["monitor"], []), "budgetgpu_inference")
    assert rules(text) == [
        # 8101 between them is not opened: it is no worker of chat's.
        "tcp dport { 8100, 8102 } ip saddr @chat_workers_v4 accept",
        "tcp dport { 8100, 8102 } ip6 saddr @chat_workers_v6 accept",
        'tcp dport { 8100, 8102 } counter reject with tcp reset comment "budgetgpu: chat workers, gateway and'
        ' Prometheus only"',
        "tcp dport { 8080 } ip saddr @chat_gateway_v4 accept",
        "tcp dport { 8080 } ip6 saddr @chat_gateway_v6 accept",
        'tcp dport { 8080 } counter reject with tcp reset comment "budgetgpu: chat gateway, its allow list only"',
        "tcp dport { 8081 } ip saddr @embed_gateway_v4 accept",
        "tcp dport { 8081 } ip6 saddr @embed_gateway_v6 accept",
        'tcp dport { 8081 } counter reject with tcp reset comment "budgetgpu: embed gateway, its allow list only"',
    ]
    found = sets(text)
    assert "elements = { 10.0.0.11, 10.0.0.13 }" in found["chat_workers_v4"]
    assert "elements = { fd00::13 }" in found["chat_workers_v6"]
    # Preflight refuses an empty allow list; were it to get here, nobody is admitted, not everybody.
    assert "elements" not in found["embed_gateway_v4"] and "elements" not in found["embed_gateway_v6"]


def test_the_training_table_drops_and_its_member_lines_read_back_as_recorded():
    records = {
        "node1": {"ipv4": ["10.9.0.2"], "ipv6": [], "source": "facts"},
        "node2": {"ipv4": ["10.9.0.3"], "ipv6": ["fd00::3"], "source": "record"},
        "node3": {"ipv4": [], "ipv6": [], "source": ""},
    }
    entry = {
        "name": "members",
        "port": ["29500", "60000-61000"],
        "what": "rendezvous and NCCL",
        "only": "members",
        "hosts": [],
        "extra": ["10.9.0.2", "10.9.0.3", "fd00::3"],
        "verdict": "drop",
    }
    text = render([entry], "budgetgpu", nccl_member_lines(records))
    assert "table inet budgetgpu {" in text
    assert (
        rules(text)[-1]
        == 'tcp dport { 29500, 60000-61000 } counter drop comment "budgetgpu: rendezvous and NCCL, members"'
    )
    assert nccl_recorded_members(text) == {
        "node1": {"ipv4": ["10.9.0.2"], "ipv6": []},
        "node2": {"ipv4": ["10.9.0.3"], "ipv6": ["fd00::3"]},
    }


# Two jobs on node1 with users of their own (a on node1 and node2, b on node1 alone), one on node3 alone, one removed.
TRAINING_JOBS = [
    {"name": "a", "nodes": "pair", "port": 29500, "store_port": 30500, "user": "alice", "state": "started"},
    {"name": "b", "nodes": "solo", "port": 29501, "store_port": 30501, "user": "bob", "state": "started"},
    {"name": "c", "nodes": "far", "port": 29502, "store_port": 30502, "user": "carol", "state": "started"},
    {"name": "old", "nodes": "pair", "port": 29600, "store_port": 30600, "user": "alice", "state": "absent"},
]
TRAINING_USERS = {"alice": ["x", "1001"], "bob": ["x", "1002"], "budgetgpu": ["x", "999"]}


def training_table(host: str) -> str:
    """The training table of host as role nccl_network renders it: its plan's entries (the ephemeral range aside)."""
    hostvars = {"node1": net("10.0.0.11"), "node2": net("10.0.0.12", "fd00::12"), "node3": net("10.0.0.13")}
    plan = nccl_network_plan(
        {
            "host": host,
            "os_family": "Debian",
            "group": "gpu_nodes",
            "members": list(hostvars),
            "hostvars": hostvars,
            "play_hosts_all": list(hostvars),
            "play_hosts": list(hostvars),
            "firewall": True,
            "firewall_file": "/etc/nftables.d/budgetgpu.nft",
            "subnet": "10.0.0.0/24",
            "record": "",
            "jobs": TRAINING_JOBS,
            "groups": {"pair": ["node1", "node2"], "solo": ["node1"], "far": ["node3"]},
            "user": "budgetgpu",
            "test_ports": [29499, 29510, 5201],
            "allowed_sources": [],
        }
    )
    return render(plan["firewall_ports"], "budgetgpu", plan["member_lines"], TRAINING_USERS)


def test_the_training_table_gives_each_job_of_the_node_its_ports_from_its_nodes_and_for_its_user_alone():
    """Issue 40: two jobs on a node reach each other's stores no more, and a member outside a job reaches none of its
    ports; the test ports and the ports of jobs elsewhere stay with every member and the test's user."""
    text = training_table("node1")
    found = sets(text)
    assert "elements = { 10.0.0.11, 10.0.0.12 }" in found["job_a_v4"] and "fd00::12" in found["job_a_v6"]
    assert "elements = { 10.0.0.11 }" in found["job_b_v4"] and "elements" not in found["job_b_v6"]
    assert "elements = { 10.0.0.11, 10.0.0.12, 10.0.0.13 }" in found["members_v4"]
    others = "5201, 29499, 29502, 29510, 29600, 30502, 30600"
    assert rules(text[: text.index("chain output {")]) == [
        "tcp dport { 29500, 30500 } ip saddr @job_a_v4 accept",
        "tcp dport { 29500, 30500 } ip6 saddr @job_a_v6 accept",
        "tcp dport { 29500, 30500 } counter drop comment"
        ' "budgetgpu: job a\'s rendezvous and worker store, its nodes only"',
        "tcp dport { 29501, 30501 } ip saddr @job_b_v4 accept",
        "tcp dport { 29501, 30501 } ip6 saddr @job_b_v6 accept",
        "tcp dport { 29501, 30501 } counter drop comment"
        ' "budgetgpu: job b\'s rendezvous and worker store, its nodes only"',
        f"tcp dport {{ {others} }} ip saddr @members_v4 accept",
        f"tcp dport {{ {others} }} ip6 saddr @members_v6 accept",
        f"tcp dport {{ {others} }} counter drop comment"
        ' "budgetgpu: reachability, comm test, iperf3 and other jobs\' ports, members only"',
    ]
    # From the node, to itself or to the job's other nodes (whose own table checks the same job's user): root and
    # the job's user only, each job its own.
    refused = [rule.split(" counter ")[0] for rule in rules(text[text.index("chain output {") :])]
    assert refused == [
        "tcp dport { 29500, 30500 } ct state new fib daddr type local meta skuid != { 0, 1001 }",
        "tcp dport { 29500, 30500 } ct state new ip daddr @job_a_v4 meta skuid != { 0, 1001 }",
        "tcp dport { 29500, 30500 } ct state new ip6 daddr @job_a_v6 meta skuid != { 0, 1001 }",
        "tcp dport { 29501, 30501 } ct state new fib daddr type local meta skuid != { 0, 1002 }",
        "tcp dport { 29501, 30501 } ct state new ip daddr @job_b_v4 meta skuid != { 0, 1002 }",
        "tcp dport { 29501, 30501 } ct state new ip6 daddr @job_b_v6 meta skuid != { 0, 1002 }",
        f"tcp dport {{ {others} }} ct state new fib daddr type local meta skuid != {{ 0, 999 }}",
        f"tcp dport {{ {others} }} ct state new ip daddr @members_v4 meta skuid != {{ 0, 999 }}",
        f"tcp dport {{ {others} }} ct state new ip6 daddr @members_v6 meta skuid != {{ 0, 999 }}",
    ]
    assert (
        "#   29500, 30500 (job a's rendezvous and worker store): 10.0.0.11, 10.0.0.12, fd00::12; from this node and to"
        " them: root, alice" in text
    )
    # node2 runs job a alone: b's ports are among the others there, a's store is a's again.
    node2 = training_table("node2")
    assert "tcp dport { 29500, 30500 } ct state new ip daddr @job_a_v4 meta skuid != { 0, 1001 }" in node2
    assert "job_b" not in node2 and "29501, 29502," in node2
    # The next run writes the same file (the member lines it reads back are its own).
    assert training_table("node1") == text


def test_the_gateways_node_lets_only_nginx_and_prometheus_reach_the_other_nodes_workers():
    """Issue 40: node2's workers admit the gateway's address, whichever process on node1 sends from it; node1 serves
    nothing on those ports, so it has no input rule for them, only the check of its own users' connections there."""
    gateways = [
        {
            "name": "chat",
            "state": "started",
            "gateway_port": 8080,
            "allow": ["10.0.0.0/24"],
            "gateway_host": "node1",
            "upstreams": [
                {"address": "10.0.0.11:8100", "node": "node1"},
                {"address": "10.0.0.12:8100", "node": "node2"},
                {"address": "[fd00::13]:8102", "node": "node3"},
            ],
        },
        {
            "name": "solo",
            "state": "started",
            "gateway_port": 8081,
            "allow": [],
            "gateway_host": "node1",
            "upstreams": [{"address": "10.0.0.11:8200", "node": "node1"}],
        },  # fmt: skip
    ]
    entries = inference_firewall_ports([], gateways, ["monitor"], [])
    local = {"local": ["www-data", "prometheus"]}
    text = render([{**e, **local} if e["what"].endswith(" workers") else e for e in entries], passwd=PASSWD)
    # One entry per node, its own ports to its own address: node3's 8102 is not checked on node2.
    assert [rule.split(" counter ")[0] for rule in rules(text) if "810" in rule] == [
        "tcp dport { 8100 } ct state new ip daddr @chat_node2_s_workers_v4 meta skuid != { 0, 33, 998 }",
        "tcp dport { 8100 } ct state new ip6 daddr @chat_node2_s_workers_v6 meta skuid != { 0, 33, 998 }",
        "tcp dport { 8102 } ct state new ip daddr @chat_node3_s_workers_v4 meta skuid != { 0, 33, 998 }",
        "tcp dport { 8102 } ct state new ip6 daddr @chat_node3_s_workers_v6 meta skuid != { 0, 33, 998 }",
    ]
    found = sets(text)
    assert "elements = { 10.0.0.12 }" in found["chat_node2_s_workers_v4"]
    assert "elements" not in found["chat_node2_s_workers_v6"]
    assert "elements = { fd00::13 }" in found["chat_node3_s_workers_v6"]
    assert (
        "#   8100 (chat node2's workers): served there, 10.0.0.12; from this node to them: root, www-data, prometheus"
        in text
    )
    # This node serves nothing there: no input rule, no check of connections to its own addresses.
    assert "8102" not in text[text.index("chain input {") : text.index("chain output {")]
    # A service whose workers are all on the gateway's node: nothing more.
    assert "solo_" not in text.replace("solo_gateway", "")
    with pytest.raises(ValueError, match="client_only: found true, expected local users too"):
        firewall_rules([e for e in entries if e.get("client_only")], HOSTVARS)


def test_an_entry_checked_to_its_hosts_names_its_users_and_each_entry_has_sets_of_its_own():
    entry = {"port": 9100, "what": "exporter", "only": "Prometheus", "hosts": ["monitor"], "extra": []}
    with pytest.raises(ValueError, match="local_to_hosts: found true, expected local users too"):
        firewall_rules([{**entry, "local_to_hosts": True}], HOSTVARS)
    with pytest.raises(ValueError, match="name: found 'job_a_b' twice"):
        firewall_rules([{**entry, "name": "job a.b"}, {**entry, "name": "job a-b"}], HOSTVARS)
    # Opt-in: the other callers' output rules stay to the node's own addresses.
    text = render([{**entry, "local": ["prometheus"]}], passwd=PASSWD)
    assert "daddr @" not in text and "fib daddr type local" in text


def test_every_caller_includes_the_role_with_a_table_of_its_own():
    names = {}
    for role in CALLERS:
        for path in sorted((ROLES / role / "tasks").glob("*.yml")):
            for task in yaml.safe_load(path.read_text()) or []:
                include = task.get("ansible.builtin.include_role") or {}
                if include.get("name") == "budgetgpu.cluster._firewall":
                    names[role] = task["vars"]["_firewall_name"]
    assert set(names) == set(CALLERS), "a caller without role _firewall keeps a firewall of its own"
    assert len(set(names.values())) == len(CALLERS), f"two callers would replace each other's table: {names}"
    # One nft template for the tables of fixed ports, role _firewall's. Role slurm's jobs table is not one of them: the
    # Prolog fills its set of `uid . port` while jobs run, so a reload keeps its elements where _firewall replaces all.
    templates = sorted(str(path.relative_to(ROLES)) for path in ROLES.glob("*/templates/*.nft.j2"))
    assert templates == ["_firewall/templates/budgetgpu.nft.j2", "slurm/templates/slurm-jobs.nft.j2"], templates


PASSWD = {
    "www-data": ["x", "33", "33", "www-data", "/var/www", "/usr/sbin/nologin"],
    "prometheus": ["x", "998", "997", "Prometheus daemon", "/var/lib/prometheus", "/usr/sbin/nologin"],
}


def test_local_users_are_checked_in_output_by_their_socket_owner_new_connections_only():
    entries = [
        {
            "port": 9093,
            "what": "Alertmanager",
            "only": "its clients",
            "hosts": ["monitor"],
            "extra": [],
            "local": ["prometheus"],
        },
        {"port": 9094, "what": "cluster port", "only": "nobody", "hosts": [], "extra": [], "local": []},
        {"port": 6817, "what": "Slurm", "only": "cluster", "hosts": ["node1"], "extra": []},
    ]
    text = render(entries, "budgetgpu_alertmanager", passwd=PASSWD)
    output = text[text.index("chain output {") :]
    assert "type filter hook output priority filter - 5; policy accept;" in output
    assert list(rules(output)) == [
        "tcp dport { 9093 } ct state new fib daddr type local meta skuid != { 0, 998 } counter reject with tcp reset"
        ' comment "budgetgpu: Alertmanager, from this node root, prometheus only"',
        "tcp dport { 9094 } ct state new fib daddr type local meta skuid != { 0 } counter reject with tcp reset"
        ' comment "budgetgpu: cluster port, from this node root only"',
    ]
    # Slurm's port names no local users: every local user still reaches it (srun).
    assert "6817" not in output
    assert "#   9093 (Alertmanager): monitor; from this node: root, prometheus" in text
    assert "#   6817 (Slurm): node1; from this node: every local user" in text


def test_a_table_without_local_users_has_no_output_chain():
    text = render(
        [{"port": 9090, "what": "Prometheus", "only": "its clients", "hosts": ["monitor"], "extra": []}], passwd=PASSWD
    )
    assert "chain output {" not in text and "meta skuid" not in text


def test_the_file_records_its_hosts_and_a_down_host_keeps_its_place_from_the_record():
    entry = {
        "port": 9100,
        "what": "node exporter",
        "only": "Prometheus only",
        "hosts": ["monitor", "node7"],
        "extra": [],
    }
    # node7 is down in this run (no facts); the last run's file recorded it.
    text = render([entry], "budgetgpu_metrics", passwd=PASSWD, recorded="# member node7: 10.0.0.17\n")
    assert "elements = { 10.0.0.13, 10.0.0.17 }" in sets(text)["node_exporter_v4"]
    assert nccl_recorded_members(text) == {
        "monitor": {"ipv4": ["10.0.0.13"], "ipv6": ["fd00::13"]},
        "node7": {"ipv4": ["10.0.0.17"], "ipv6": []},
    }


def test_callers_name_who_may_connect_from_the_node():
    local, training = {}, {}
    for role in ("alertmanager", "prometheus", "node_exporter", "nccl_network"):
        for path in sorted((ROLES / role / "tasks").glob("*.yml")):
            for task in yaml.safe_load(path.read_text()) or []:
                include = task.get("ansible.builtin.include_role") or {}
                if include.get("name") == "budgetgpu.cluster._firewall":
                    entries = task["vars"]["_firewall_ports"]
                    local[role] = entries if isinstance(entries, str) else [rule.get("local") for rule in entries]
                    training = task["vars"] if role == "nccl_network" else training
    assert local["alertmanager"] == [["prometheus"], []]
    assert local["prometheus"] == [["prometheus"]] and local["node_exporter"] == [["prometheus"]]
    # The training table: the plan's entries name each job's user and the test's (nccl_firewall_ports, tested
    # below), the ephemeral range (NCCL/gloo, a Slurm job's own ranks) stays open to every local user.
    assert local["nccl_network"] == "{{ _nccl_network_plan['firewall_ports'] + [__nccl_network_range_entry] }}"
    assert "local" not in training["__nccl_network_range_entry"]


def test_the_next_run_writes_the_same_table_and_a_host_gone_down_changes_nothing_but_its_facts_source():
    entry = {
        "port": [6817, "60001-60100"],
        "what": "Slurm",
        "only": "cluster",
        "hosts": ["monitor", "node1"],
        "extra": [],
    }
    first = render([entry], "budgetgpu_slurm", passwd=PASSWD)
    # The next run reads the file back: the same text (the idempotence step of every scenario).
    assert render([entry], "budgetgpu_slurm", passwd=PASSWD, recorded=first) == first
    # node1 is down the night after: no facts, its record keeps the table as it was.
    down = dict(HOSTVARS)
    del down["node1"]
    rules_down = firewall_rules([entry], down, PASSWD, first)
    assert rules_down[0]["stale"] == ["node1"]
    assert rules_down[0]["allow"] == firewall_rules([entry], HOSTVARS, PASSWD, first)[0]["allow"]


def test_inference_gives_its_worker_entries_alone_local_users():
    """Role inference picks its worker entries by their `what` (" workers" at the end) to name NGINX's and
    Prometheus' users: a job on the node calls the gateway, which stays open to every local user."""
    tasks = yaml.safe_load((ROLES / "inference/tasks/main.yml").read_text())
    (include,) = [
        t for t in tasks if (t.get("ansible.builtin.include_role") or {}).get("name") == "budgetgpu.cluster._firewall"
    ]
    assert "selectattr('what', 'search', ' workers$')" in include["vars"]["_firewall_ports"]
    assert "['www-data']" in include["vars"]["__inference_local"]
    plan = [{"name": "chat", "state": "started", "gateway_address": "10.0.0.11", "workers": [{"port": 8100}]}]
    gateways = [{"name": "chat", "state": "started", "gateway_port": 8080, "allow": ["10.0.0.0/24"]}]
    entries = inference_firewall_ports(plan, gateways, ["monitor"], [])
    assert [bool(re.search(" workers$", e["what"])) for e in entries] == [True, False]
