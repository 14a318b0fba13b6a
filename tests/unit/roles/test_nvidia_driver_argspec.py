"""nvidia_driver and cuda refuse bad input before any change, naming the variable and the host.

Each case is a fake host (local connection, --check) with the probe facts preset and its own bad
input as host vars; one ansible-playbook run per role takes every case (a run per case cost about
3 s of start-up each), and each host must stop at its first failure: no node, no Docker.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import host_results, run_batch, texts_of

REPO = Path(__file__).resolve().parents[3]
PLAYBOOK = """\
- name: Run {role}
  hosts: all
  gather_facts: false
  pre_tasks:
    - name: Pretend the probes ran
      ansible.builtin.set_fact:
        budgetgpu_gpus: "{{{{ test_gpus | default({{'driver': {{'state': 'no_driver'}}, 'gpus': []}}) }}}}"
        budgetgpu_pcie: "{{{{ test_pcie | default({{'gpus': []}}) }}}}"
        cacheable: true
  roles:
    - role: budgetgpu.cluster.{role}
"""
GTX_1080_TI = {"bus_id": "0000:03:00.0", "device_id": "0x1b06"}
SECURE_BOOT_ON = bytes([6, 0, 0, 0, 1])
SECURE_BOOT_OFF = bytes([6, 0, 0, 0, 0])


def os_release() -> dict[str, str]:
    text = Path("/etc/os-release").read_text()
    return dict(re.findall(r'^(\w+)="?([^"\n]*)"?$', text, re.MULTILINE))


ON_DEBIAN_12 = os_release().get("ID") == "debian" and os_release().get("VERSION_ID") == "12"


def efivars(tmp_path: Path, value: bytes | None) -> str:
    folder = tmp_path / "efivars"
    folder.mkdir(parents=True, exist_ok=True)
    if value is not None:
        (folder / "SecureBoot-8be4df61-93ca-11d2-aa0d-e98c0c00d9d1").write_bytes(value)
    return str(folder)


def refusals(tmp_path: Path, role: str, cases: dict[str, tuple[dict, tuple[str, ...]]]) -> list[str]:
    """Run `role` once on one host per case ({host: (variables, texts the refusal must hold)});
    return what went wrong, per host: an empty list when every case was refused as it must be."""
    host_vars = {
        host: {"nvidia_driver_efivars_path": efivars(tmp_path / host, None), **variables}
        for host, (variables, _texts) in cases.items()
    }
    report = run_batch(tmp_path, PLAYBOOK.format(role=role), host_vars, options=("--check",))
    wrong = []
    for host, (_variables, texts) in cases.items():
        results = host_results(report, host)
        failed = [(name, result) for name, result in results if result.get("failed")]
        if not failed:
            wrong.append(f"{host}: not refused ({[name for name, _result in results]})")
            continue
        message = texts_of(failed[0][1])
        wrong += [f"{host}: {text!r} not in {message!r}" for text in texts if text.format(host=host) not in message]
        # It failed before anything (even in check mode) would change.
        if report["stats"][host]["changed"] != 0:
            wrong.append(f"{host}: changed {report['stats'][host]['changed']} before the refusal")
        ran = [
            name for name, _result in results if "Install the tools the role needs" in name or "Install NCCL" in name
        ]
        if ran:
            wrong.append(f"{host}: ran {ran} before the refusal")
    return wrong


# host: (the case's variables, what the refusal says; {host} is the host's name).
NVIDIA_DRIVER_CASES: dict[str, tuple[dict, tuple[str, ...]]] = {
    "branch_that_is_not_a_number": ({"nvidia_driver_branch": "latest"}, ("nvidia_driver_branch",)),
    "branch_that_is_not_a_driver_branch": (
        {"nvidia_driver_source": "nvidia_repo", "nvidia_driver_branch": 55},
        ("{host}: nvidia_driver_branch is '55'", "expected a driver branch number such as 550"),
    ),
    "unknown_source": ({"nvidia_driver_source": "ppa"}, ("nvidia_driver_source",)),
    "secure_boot_on_without_opt_in": (
        {"test_efivars": SECURE_BOOT_ON},
        ("{host}: Secure Boot is on and nvidia_driver_secure_boot is 'refuse'",),
    ),
    "secure_boot_mok_signed_without_a_key": (
        {"test_efivars": SECURE_BOOT_ON, "nvidia_driver_secure_boot": "mok_signed", "test_missing_mok_key": True},
        ("{host}: nvidia_driver_secure_boot is mok_signed but", "missing.key"),
    ),
    "unknown_secure_boot_choice": ({"nvidia_driver_secure_boot": "yes"}, ("nvidia_driver_secure_boot",)),
    "open_modules_on_a_gtx_1080_ti": (
        {"test_efivars": SECURE_BOOT_OFF, "nvidia_driver_kernel_modules": "open", "test_pcie": {"gpus": [GTX_1080_TI]}},
        ("{host}: nvidia_driver_kernel_modules is 'open' but 0000:03:00.0",),
    ),
    "malformed_module_options": (
        {"nvidia_driver_module_options": {"nvidia": "NVreg_X=1"}},
        ("{host}: nvidia_driver_module_options['nvidia']",),
    ),
}
# These run the role on this machine's own OS facts: a Debian 12 control machine only.
NVIDIA_DRIVER_DEBIAN_12_CASES: dict[str, tuple[dict, tuple[str, ...]]] = {
    "source_of_another_os": (
        {"nvidia_driver_source": "ubuntu"},
        ("{host}: nvidia_driver_source is 'ubuntu' but the node runs Debian",),
    ),
    "branch_debian_does_not_ship": (
        {"nvidia_driver_branch": 550},
        ("{host}: nvidia_driver_branch is 550 but Debian 12's non-free archive ships branch 535",),
    ),
}
CUDA_CASES: dict[str, tuple[dict, tuple[str, ...]]] = {
    "cuda_version_not_major_minor": ({"cuda_version": "twelve"}, ("{host}: cuda_version is 'twelve'",)),
    "nccl_built_for_another_cuda_major": (
        {"cuda_version": "12.4", "cuda_nccl_version": "2.21.5-1+cuda11.0"},
        ("{host}: cuda_nccl_version is '2.21.5-1+cuda11.0' but cuda_version is 12.4",),
    ),
    "cuda_newer_than_the_driver": (
        {
            "test_gpus": {
                "driver": {"state": "loaded", "version": "470.256.02", "cuda_driver_version": "11.4"},
                "gpus": [],
            }
        },
        ("{host}: cuda_version is 12.4 but the loaded driver 470.256.02 runs CUDA 11.4 at most",),
    ),
}
CUDA_DEBIAN_12_CASES: dict[str, tuple[dict, tuple[str, ...]]] = {
    "debian_toolkit_of_another_cuda": (
        {"cuda_toolkit_install": True, "cuda_toolkit_source": "distro"},
        ("{host}: cuda_version is 12.4 but Debian 12", "nvidia-cuda-toolkit is CUDA 11.8"),
    ),
}


def with_files(
    tmp_path: Path, cases: dict[str, tuple[dict, tuple[str, ...]]]
) -> dict[str, tuple[dict, tuple[str, ...]]]:
    """The cases with their files made: an efivars folder holding a Secure Boot variable, a key path that is missing."""
    made = {}
    for host, (variables, texts) in cases.items():
        variables = dict(variables)
        if "test_efivars" in variables:
            variables["nvidia_driver_efivars_path"] = efivars(tmp_path / host, variables.pop("test_efivars"))
        if variables.pop("test_missing_mok_key", False):
            variables["nvidia_driver_mok_key"] = str(tmp_path / host / "missing.key")
        made[host] = (variables, texts)
    return made


def test_nvidia_driver_refuses_each_bad_input_before_any_change(tmp_path):
    cases = NVIDIA_DRIVER_CASES | (NVIDIA_DRIVER_DEBIAN_12_CASES if ON_DEBIAN_12 else {})
    assert refusals(tmp_path, "nvidia_driver", with_files(tmp_path, cases)) == []


def test_cuda_refuses_each_bad_input_before_any_change(tmp_path):
    cases = CUDA_CASES | (CUDA_DEBIAN_12_CASES if ON_DEBIAN_12 else {})
    assert refusals(tmp_path, "cuda", with_files(tmp_path, cases)) == []


@pytest.mark.parametrize("role", ["nvidia_driver", "cuda"])
def test_defaults_and_argument_specs_agree(role):
    # The README holds no table of them (tests/unit/test_docs.py): the argument spec is their one description.
    root = REPO / "roles" / role
    defaults = yaml.safe_load((root / "defaults" / "main.yml").read_text())
    options = yaml.safe_load((root / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    assert set(defaults) == set(options)
    for name, spec in options.items():
        assert spec.get("default") == defaults[name], name
        assert spec.get("description"), name
