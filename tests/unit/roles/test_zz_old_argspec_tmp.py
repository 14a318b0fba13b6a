"""nvidia_driver and cuda refuse bad input before any change, naming the variable and the host.

Each case runs the role with ansible-playbook on a fake host (local connection, --check) with the
probe facts preset, and stops at the first failure: no node, no Docker, a few seconds each.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import run_playbook

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
    folder.mkdir(exist_ok=True)
    if value is not None:
        (folder / "SecureBoot-8be4df61-93ca-11d2-aa0d-e98c0c00d9d1").write_bytes(value)
    return str(folder)


def run_role(tmp_path: Path, role: str, extra_vars: dict) -> subprocess.CompletedProcess[str]:
    variables = {"nvidia_driver_efivars_path": efivars(tmp_path, None), **extra_vars}
    return run_playbook(tmp_path, PLAYBOOK.format(role=role), variables, options=("--check",))


def assert_refused(result: subprocess.CompletedProcess[str], *expected: str) -> None:
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode != 0, output
    assert "fatal: [node7]" in output or "failed: [node7]" in output, output
    for text in expected:
        assert text in output, output
    # It failed before anything (even in check mode) would change.
    assert re.search(r"node7\s*: ok=\d+\s+changed=0 ", output), output
    assert "Install the tools the role needs" not in output and "Install NCCL" not in output, output


def test_branch_that_is_not_a_number(tmp_path):
    assert_refused(run_role(tmp_path, "nvidia_driver", {"nvidia_driver_branch": "latest"}), "nvidia_driver_branch")


def test_branch_that_is_not_a_driver_branch(tmp_path):
    assert_refused(
        run_role(tmp_path, "nvidia_driver", {"nvidia_driver_source": "nvidia_repo", "nvidia_driver_branch": 55}),
        "node7: nvidia_driver_branch is '55'",
        "expected a driver branch number such as 550",
    )


def test_unknown_source(tmp_path):
    assert_refused(run_role(tmp_path, "nvidia_driver", {"nvidia_driver_source": "ppa"}), "nvidia_driver_source")


def test_secure_boot_on_without_opt_in(tmp_path):
    assert_refused(
        run_role(tmp_path, "nvidia_driver", {"nvidia_driver_efivars_path": efivars(tmp_path, SECURE_BOOT_ON)}),
        "node7: Secure Boot is on and nvidia_driver_secure_boot is 'refuse'",
    )


def test_secure_boot_mok_signed_without_a_key(tmp_path):
    assert_refused(
        run_role(
            tmp_path,
            "nvidia_driver",
            {
                "nvidia_driver_efivars_path": efivars(tmp_path, SECURE_BOOT_ON),
                "nvidia_driver_secure_boot": "mok_signed",
                "nvidia_driver_mok_key": str(tmp_path / "missing.key"),
            },
        ),
        "node7: nvidia_driver_secure_boot is mok_signed but",
        "missing.key",
    )


def test_unknown_secure_boot_choice(tmp_path):
    assert_refused(
        run_role(tmp_path, "nvidia_driver", {"nvidia_driver_secure_boot": "yes"}), "nvidia_driver_secure_boot"
    )


def test_open_modules_on_a_gtx_1080_ti(tmp_path):
    assert_refused(
        run_role(
            tmp_path,
            "nvidia_driver",
            {
                "nvidia_driver_efivars_path": efivars(tmp_path, SECURE_BOOT_OFF),
                "nvidia_driver_kernel_modules": "open",
                "test_pcie": {"gpus": [GTX_1080_TI]},
            },
        ),
        "node7: nvidia_driver_kernel_modules is 'open' but 0000:03:00.0",
    )


def test_malformed_module_options(tmp_path):
    assert_refused(
        run_role(tmp_path, "nvidia_driver", {"nvidia_driver_module_options": {"nvidia": "NVreg_X=1"}}),
        "node7: nvidia_driver_module_options['nvidia']",
    )


@pytest.mark.skipif(not ON_DEBIAN_12, reason="needs a Debian 12 control machine (runs the role on itself)")
def test_source_of_another_os(tmp_path):
    assert_refused(
        run_role(tmp_path, "nvidia_driver", {"nvidia_driver_source": "ubuntu"}),
        "node7: nvidia_driver_source is 'ubuntu' but the node runs Debian",
    )


@pytest.mark.skipif(not ON_DEBIAN_12, reason="needs a Debian 12 control machine (runs the role on itself)")
def test_branch_debian_does_not_ship(tmp_path):
    assert_refused(
        run_role(tmp_path, "nvidia_driver", {"nvidia_driver_branch": 550}),
        "node7: nvidia_driver_branch is 550 but Debian 12's non-free archive ships branch 535",
    )


def test_cuda_version_not_major_minor(tmp_path):
    assert_refused(run_role(tmp_path, "cuda", {"cuda_version": "twelve"}), "node7: cuda_version is 'twelve'")


def test_nccl_built_for_another_cuda_major(tmp_path):
    assert_refused(
        run_role(tmp_path, "cuda", {"cuda_version": "12.4", "cuda_nccl_version": "2.21.5-1+cuda11.0"}),
        "node7: cuda_nccl_version is '2.21.5-1+cuda11.0' but cuda_version is 12.4",
    )


def test_cuda_newer_than_the_driver(tmp_path):
    driver = {"driver": {"state": "loaded", "version": "470.256.02", "cuda_driver_version": "11.4"}, "gpus": []}
    assert_refused(
        run_role(tmp_path, "cuda", {"test_gpus": driver}),
        "node7: cuda_version is 12.4 but the loaded driver 470.256.02 runs CUDA 11.4 at most",
    )


@pytest.mark.skipif(not ON_DEBIAN_12, reason="needs a Debian 12 control machine (runs the role on itself)")
def test_debian_toolkit_of_another_cuda(tmp_path):
    assert_refused(
        run_role(tmp_path, "cuda", {"cuda_toolkit_install": True, "cuda_toolkit_source": "distro"}),
        "node7: cuda_version is 12.4 but Debian 12",
        "nvidia-cuda-toolkit is CUDA 11.8",
    )


@pytest.mark.parametrize("role", ["nvidia_driver", "cuda"])
def test_defaults_argument_specs_and_readme_agree(role):
    root = REPO / "roles" / role
    defaults = yaml.safe_load((root / "defaults" / "main.yml").read_text())
    options = yaml.safe_load((root / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    assert set(defaults) == set(options)
    for name, spec in options.items():
        assert spec.get("default") == defaults[name], name
        assert spec.get("description"), name
    documented = set(re.findall(r"^\| `(\w+)` \|", (root / "README.md").read_text(), re.MULTILINE))
    assert documented == set(options)
