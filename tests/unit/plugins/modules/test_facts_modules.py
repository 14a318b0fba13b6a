"""gpu_facts, pcie_facts, net_facts: arguments, check mode, facts, failures and documentation."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import yaml
from ansible.module_utils.testing import patch_module_args
from ansible_collections.budgetgpu.cluster.plugins.module_utils.netinfo import ephemeral_ports
from ansible_collections.budgetgpu.cluster.plugins.modules import gpu_facts, net_facts, pcie_facts

MODULES = {"gpu_facts": gpu_facts, "pcie_facts": pcie_facts, "net_facts": net_facts}


def run(module, args, capsys):
    """Run a module's main() with args; return (exit code, result)."""
    with patch_module_args(args), pytest.raises(SystemExit) as info:
        module.main()
    return info.value.code, json.loads(capsys.readouterr().out)


# -- gpu_facts ---------------------------------------------------------------------------


def test_gpu_facts_on_the_h200_profile_in_check_mode(monkeypatch, fake_pynvml, capsys, tmp_path):
    monkeypatch.setattr(gpu_facts, "pynvml", fake_pynvml("h200"))
    code, result = run(gpu_facts, {"_ansible_check_mode": True, "proc_root": str(tmp_path)}, capsys)
    assert code == 0 and result["changed"] is False
    facts = result["ansible_facts"]["budgetgpu_gpus"]
    assert facts["driver"]["loaded"] is True and facts["count"] == 1
    assert facts["gpus"][0]["fan_speed_pct"] == "unsupported"


def test_gpu_facts_without_driver_succeeds_and_says_why(monkeypatch, fake_pynvml, capsys, tmp_path):
    monkeypatch.setattr(gpu_facts, "pynvml", fake_pynvml("no-driver"))
    code, result = run(gpu_facts, {"proc_root": str(tmp_path), "modules_root": str(tmp_path)}, capsys)
    assert code == 0 and result["changed"] is False
    driver = result["ansible_facts"]["budgetgpu_gpus"]["driver"]
    assert (driver["state"], driver["loaded"]) == ("no_driver", False)
    assert "install the driver" in driver["reason"]


def test_gpu_facts_without_pynvml_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(gpu_facts, "pynvml", None)
    code, result = run(gpu_facts, {}, capsys)
    assert code == 1 and result["failed"] is True
    assert "nvidia-ml-py" in result["msg"] and "apt-get install python3-pynvml" in result["msg"]
    code, result = run(gpu_facts, {"on_missing_pynvml": "report"}, capsys)
    assert code == 0
    assert result["ansible_facts"]["budgetgpu_gpus"]["driver"]["state"] == "no_pynvml"


def test_gpu_facts_refuses_a_bad_option(capsys):
    code, result = run(gpu_facts, {"on_missing_pynvml": "ignore"}, capsys)
    assert code == 1
    assert "on_missing_pynvml" in result["msg"] and "fail, report" in result["msg"]


# -- pcie_facts --------------------------------------------------------------------------


def test_pcie_facts_reads_the_tree_in_check_mode(sim_tree, capsys):
    code, result = run(pcie_facts, {"sysfs_root": sim_tree("rtx3090x4-risers"), "_ansible_check_mode": True}, capsys)
    assert code == 0 and result["changed"] is False
    facts = result["ansible_facts"]["budgetgpu_pcie"]
    assert facts["count"] == 4
    assert [gpu["downgraded"] for gpu in facts["gpus"]] == [False, False, False, True]


def test_pcie_facts_fails_on_a_missed_expectation_naming_node_and_bus(sim_tree, capsys):
    args = {"sysfs_root": sim_tree("rtx3090x4-risers"), "min_width": 4, "node_name": "rig1"}
    code, result = run(pcie_facts, args, capsys)
    assert code == 1
    assert result["msg"].startswith("rig1: GPU 0000:04:00.0 runs PCIe gen3 x1 (limiting hop 0000:00:1d.0), expected x4")
    assert "reseat" in result["msg"]
    assert result["problems"] == [result["msg"]]


def test_pcie_facts_accepts_nvml_bus_ids_in_expected(sim_tree, capsys):
    args = {"sysfs_root": sim_tree("rtx3090x4-risers"), "expected": {"00000000:01:00.0": {"width": 16, "gen": 3}}}
    code, result = run(pcie_facts, args, capsys)
    assert code == 0, result.get("msg")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ({"min_width": 3}, "min_width"),
        ({"expected": {"slot1": {"width": 4}}}, "'slot1' is not a PCI bus id"),
        ({"expected": {"0000:01:00.0": {"lanes": 4}}}, "must be a mapping with width and/or gen"),
        ({"expected": {"0000:01:00.0": {"width": "wide"}}}, "must be a positive integer"),
    ],
)
def test_pcie_facts_refuses_bad_options(args, words, capsys, tmp_path):
    code, result = run(pcie_facts, {"sysfs_root": str(tmp_path), **args}, capsys)
    assert code == 1 and words in result["msg"]


# -- net_facts ---------------------------------------------------------------------------


def test_net_facts_finds_the_cluster_interface_with_ip_in_c_locale(monkeypatch, capsys):
    calls = []
    ip_json = json.dumps([{"ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]}])

    def fake_run_command(self, args, environ_update=None, **kwargs):
        calls.append((args, environ_update))
        return 0, ip_json, ""

    monkeypatch.setattr(net_facts.AnsibleModule, "run_command", fake_run_command)
    monkeypatch.setattr(net_facts.AnsibleModule, "get_bin_path", lambda self, name, *a, **k: "/usr/sbin/ip")
    code, result = run(net_facts, {"cluster_subnet": "127.0.0.0/8", "_ansible_check_mode": True}, capsys)
    assert code == 0 and result["changed"] is False
    assert calls == [(["/usr/sbin/ip", "-j", "addr", "show"], {"LANG": "C", "LC_ALL": "C", "LC_MESSAGES": "C"})]
    facts = result["ansible_facts"]["budgetgpu_net"]
    assert facts["cluster_interface"]["name"] == "lo"
    assert any(iface["name"] == "lo" and iface["kind"] == "loopback" for iface in facts["interfaces"])
    # The kernel's ephemeral range, which preflight keeps a job's store port out of.
    assert facts["ephemeral_ports"] == ephemeral_ports() and len(facts["ephemeral_ports"]) == 2


def test_net_facts_applies_the_interface_rule(monkeypatch, capsys):
    ip_json = json.dumps([{"ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]}])
    monkeypatch.setattr(net_facts.AnsibleModule, "run_command", lambda self, args, **kwargs: (0, ip_json, ""))
    monkeypatch.setattr(net_facts.AnsibleModule, "get_bin_path", lambda self, name, *a, **k: "/usr/sbin/ip")
    args = {"cluster_subnet": "127.0.0.0/8", "interface_rule": "^=lo", "_ansible_check_mode": True}
    code, result = run(net_facts, args, capsys)
    facts = result["ansible_facts"]["budgetgpu_net"]
    assert code == 0 and facts["interface_rule"] == "^=lo" and facts["cluster_interface"] is None
    assert "inventory asks for interface '^=lo' (budgetgpu_cluster_interface)" in facts["cluster_interface_error"]


def test_net_facts_refuses_a_bad_subnet(capsys):
    code, result = run(net_facts, {"cluster_subnet": "10.0.0.300/24"}, capsys)
    assert code == 1 and "cluster_subnet '10.0.0.300/24' is not a network in CIDR form" in result["msg"]


# -- documentation -----------------------------------------------------------------------


def module_docs(name):
    tree = ast.parse(Path(MODULES[name].__file__).read_text())
    docs = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") in ("DOCUMENTATION", "RETURN"):
            docs[node.targets[0].id] = yaml.safe_load(node.value.value)
    return docs


def leaves_without_sample(tree, path=""):
    for key, spec in tree.items():
        here = f"{path}.{key}" if path else key
        if "contains" in spec and "sample" not in spec:
            yield from leaves_without_sample(spec["contains"], here)
        elif "sample" not in spec:
            yield here


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_returned_leaf_has_a_sample_and_every_option_is_documented(name):
    docs = module_docs(name)
    assert list(leaves_without_sample(docs["RETURN"])) == []
    with patch_module_args({}):
        module = MODULES[name].build_module()
    documented = docs["DOCUMENTATION"]["options"]
    assert set(module.argument_spec) == set(documented)
    for option, arg in module.argument_spec.items():
        assert arg.get("default") == documented[option].get("default"), option
        assert arg.get("choices") == documented[option].get("choices"), option
