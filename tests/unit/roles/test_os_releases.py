"""What the roles pick on each OS release they claim, from that release's own files.

CI runs the roles on Debian 12 (every scenario) and Debian 13 (provision_trixie); Ubuntu's archive
cannot be reached from the build machines. These tests run the roles' real tasks and vars on a fake
host (local connection, --check) with the OS facts that `setup` reports for each release's
`/etc/os-release` (tests/fixtures/<release>/os-release, read with the `distro` library that setup
uses), and hold the answers against the release's `apt-cache policy` and `dpkg-query` listings in
the same folder. tests/fixtures/README.md says which were captured and which written.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from ansible.module_utils import distro  # what setup reads os-release with
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.driver import installed_branches
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import (
    host_results,
    output_of,
    run_batch,
    run_playbook,
    texts_of,
)

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "tests" / "fixtures"
RELEASES = ["debian-13", "ubuntu-22.04", "ubuntu-24.04"]
PYTHON = {
    "debian-12": {"major": 3, "minor": 11, "micro": 2},
    "debian-13": {"major": 3, "minor": 13, "micro": 5},
    "ubuntu-22.04": {"major": 3, "minor": 10, "micro": 12},
    "ubuntu-24.04": {"major": 3, "minor": 12, "micro": 3},
}


def setup_facts(release: str) -> dict:
    """The OS facts ansible's setup reports for the release's os-release (as get_distribution does)."""
    found = distro.LinuxDistribution(
        include_lsb=False,
        os_release_file=str(FIXTURES / release / "os-release"),
        distro_release_file="/nonexistent",
        include_uname=False,
    )
    return {
        "distribution": found.id().capitalize(),
        "distribution_version": found.version(),
        "distribution_major_version": found.version().split(".")[0],
        "distribution_release": found.codename(),
        "os_family": "Debian",
        "architecture": "x86_64",
        "kernel": "6.8.0-45-generic",
        "virtualization_type": "kvm",
        "virtualization_role": "host",
        # The interpreter Ansible runs on the node: the release's python3.
        "python": {"executable": "/usr/bin/python3", "version": PYTHON[release]},
    }


def apt_policy(release: str) -> dict[str, dict]:
    """`apt-cache policy PKG...` as {package: {"candidate": version, "versions": [...]}}."""
    packages: dict[str, dict] = {}
    current = None
    for line in (FIXTURES / release / "apt-cache-policy.txt").read_text().splitlines():
        if re.match(r"^\S+:$", line):
            current = packages.setdefault(line[:-1], {"candidate": None, "versions": []})
        elif match := re.match(r"^  Candidate: (\S+)$", line):
            current["candidate"] = None if match.group(1) == "(none)" else match.group(1)
        elif match := re.match(r"^ (?:\*\*\*| {3}) (\S+) -?\d+$", line):
            current["versions"].append(match.group(1))
    return packages


def dpkg_packages(release: str) -> dict[str, list[dict]]:
    """`dpkg-query -W -f '${Package} ${Version}\\n'` as package_facts returns it."""
    listing = (FIXTURES / release / "dpkg-query.txt").read_text().split("\n")
    return {
        name: [{"name": name, "version": version, "source": "apt"}]
        for name, version in (line.split(" ", 1) for line in listing if line.strip())
    }


def apt_pin_matches(pin: str, version: str) -> bool:
    """Whether an apt preferences `Pin: version GLOB` line matches a version (fnmatch, as apt does)."""
    from fnmatch import fnmatchcase

    glob = re.search(r"^Pin: version (\S+)$", pin, re.MULTILINE).group(1)
    return fnmatchcase(version, glob)


FACT_NAMES = list(setup_facts(RELEASES[0]))
ROLE_PLAY = """\
- name: Run {role}'s preflight as on each host's release
  hosts: all
  gather_facts: false
  pre_tasks:
    - name: Pretend setup and the probes ran on the release
      ansible.builtin.set_fact:
        cacheable: true
        budgetgpu_gpus: {{driver: {{state: no_driver}}, gpus: []}}
        budgetgpu_pcie: {{gpus: []}}
        {facts}
      tags: [always]
  roles:
    - role: budgetgpu.cluster.{role}
  post_tasks:
    # In the json report (run_batch): a copy to a file ran a module on every host, 0.5 s each.
    - name: Say what the role decided
      ansible.builtin.debug:
        msg: "{{{{ {report} | to_json }}}}"
      tags: [always]
""".replace("{facts}", "\n        ".join(f"{name}: \"{{{{{{{{ test_facts['{name}'] }}}}}}}}\"" for name in FACT_NAMES))


def run_preflights(tmp_path: Path, role: str, cases: dict[str, tuple[str, dict]], report: str) -> dict[str, dict]:
    """One ansible-playbook run of `role`'s preflight on one fake host per case ({host: (release,
    variables)}): each host has its release's setup facts. Returns {host: what the role decided}."""
    host_vars = {
        host: {
            "test_facts": setup_facts(release),
            "nvidia_driver_efivars_path": str(tmp_path / "no-efivars"),
            "test_templates": str(REPO / "roles" / role / "templates"),
            **variables,
        }
        for host, (release, variables) in cases.items()
    }
    play = ROLE_PLAY.format(role=role, report=report)
    report = run_batch(tmp_path, play, host_vars, options=("--check", "--tags", f"{role}_preflight"))
    assert all(report["stats"][host]["failures"] == report["stats"][host]["unreachable"] == 0 for host in cases), (
        report["stats"],
        [texts_of(result) for host in cases for _name, result in host_results(report, host) if result.get("failed")],
    )
    return {host: json.loads(dict(host_results(report, host))["Say what the role decided"]["msg"]) for host in cases}


def run_preflight(tmp_path: Path, role: str, release: str, report: str, extra_vars: dict | None = None) -> dict:
    """One case of run_preflights, on node7."""
    return run_preflights(tmp_path, role, {"node7": (release, extra_vars or {})}, report)["node7"]


NVIDIA_REPORT = (
    "{'packages': _nvidia_driver_packages, 'branch': _nvidia_driver_branch | int, 'source': _nvidia_driver_source,"
    " 'pynvml': _nvidia_driver_pynvml_package, 'cuda_repo_distro': _nvidia_driver_cuda_repo_distro,"
    " 'pin': lookup('ansible.builtin.template', test_templates ~ '/driver-pin.j2')}"
)


EXPECTED = {
    "debian-13": {"source": "debian", "branch": 550, "cuda_repo_distro": "debian13", "pynvml": "python3-pynvml",
                  "packages": ["nvidia-driver", "nvidia-kernel-dkms", "nvidia-persistenced"]},
    "ubuntu-22.04": {"source": "ubuntu", "branch": 550, "cuda_repo_distro": "ubuntu2204", "pynvml": "python3-pynvml",
                     "packages": ["nvidia-driver-550"]},
    "ubuntu-24.04": {"source": "ubuntu", "branch": 550, "cuda_repo_distro": "ubuntu2404", "pynvml": "python3-pynvml",
                     "packages": ["nvidia-driver-550"]},
}  # fmt: skip
HEADLESS_FIRST = {"debian-13": "nvidia-kernel-dkms", "ubuntu-22.04": "nvidia-headless-550",
                  "ubuntu-24.04": "nvidia-headless-550"}  # fmt: skip


def test_driver_packages_exist_in_the_release_and_the_pin_keeps_their_candidate(tmp_path):
    cases = {
        f"{release}-{'headless' if headless else 'full'}": (release, {"nvidia_driver_headless": headless})
        for release in RELEASES
        for headless in (False, True)
    }
    decisions = run_preflights(tmp_path, "nvidia_driver", cases, NVIDIA_REPORT)
    for host, (release, variables) in cases.items():
        decided = decisions[host]
        if variables["nvidia_driver_headless"]:
            assert decided["packages"][0] == HEADLESS_FIRST[release], host
        else:
            assert {key: decided[key] for key in EXPECTED[release]} == EXPECTED[release], host
        policy = apt_policy(release)
        # The first package carries the driver version (run.yml reads it): the archive must have it,
        # and the branch pin must let apt install its candidate.
        first = decided["packages"][0]
        assert first in policy, f"{host}: the role installs {first}, which the archive's policy does not list"
        candidate = policy[first]["candidate"]
        assert candidate, f"{host}: {first} has no candidate"
        assert apt_pin_matches(decided["pin"], candidate), f"{host}: pin {decided['pin']!r} excludes {candidate}"
        assert int(candidate.split(".")[0]) == decided["branch"], host


def _role_task(role: str, tasks_file: str, name: str) -> dict:
    tasks = yaml.safe_load((REPO / "roles" / role / "tasks" / tasks_file).read_text())
    return next(task for task in tasks if task.get("name") == name)


TASK_PLAY = """\
- name: Run one task of {role} on a node's package list
  hosts: all
  gather_facts: false
  vars_files: [{vars_file}]
  vars: {play_vars}
  pre_tasks:
    - name: Pretend setup and package_facts ran on a Debian node
      ansible.builtin.set_fact:
        cacheable: true
        distribution: Debian
        packages: "{{{{ test_packages }}}}"
  tasks:
    - {task}
    - name: Write the answer
      ansible.builtin.copy:
        content: "{{{{ {report} | to_json }}}}"
        dest: "{{{{ report_file }}}}"
        mode: "0644"
"""


# Debian 13's nvidia-kernel-support pulls nvidia-modprobe 570.133.07 beside driver 550; Ubuntu's
# nvidia-settings is 510.47.03 beside any driver. Neither is an installed driver branch.
INSTALLED_BRANCHES = {"debian-13": [550], "ubuntu-22.04": [550], "ubuntu-24.04": [550]}


def test_installed_branches_come_from_the_driver_packages_only():
    # The role's plan (nvidia_driver_plan) takes them from package_facts with installed_branches, less the role's
    # packages whose versions follow releases of their own.
    own = yaml.safe_load((REPO / "roles" / "nvidia_driver" / "vars" / "main.yml").read_text())
    found = {
        release: installed_branches(dpkg_packages(release), own["_nvidia_driver_own_release_packages"])
        for release in INSTALLED_BRANCHES
    }
    assert found == INSTALLED_BRANCHES


KEYRING_TASK = "Find the keyring that the node's own Debian sources name"
DEBIAN_SOURCES = {
    # Debian 13 as `apt modernize-sources` writes it, and as the budgetgpu trixie image has it.
    "trixie-pgp": ("debian.sources", (FIXTURES / "debian-13" / "debian.sources").read_text()),
    # Debian 12's deb822 file of the Docker image and the cloud images.
    "bookworm-gpg": (
        "debian.sources",
        "Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\nComponents: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n",
    ),
    # An installer's one-line sources.list without signed-by: apt's trusted keyrings apply.
    "one-line": ("sources.list", "deb http://deb.debian.org/debian bookworm main\n"),
}
EXPECTED_KEYRING = {
    "trixie-pgp": "/usr/share/keyrings/debian-archive-keyring.pgp",
    "bookworm-gpg": "/usr/share/keyrings/debian-archive-keyring.gpg",
    "one-line": "/usr/share/keyrings/debian-archive-keyring.gpg",
}


@pytest.mark.parametrize("case", sorted(DEBIAN_SOURCES))
def test_nonfree_sources_name_the_keyring_of_the_nodes_own_sources(tmp_path, case):
    # apt refuses every update when two entries for one mirror and suite name different Signed-By
    # keyrings ("Conflicting values set for option Signed-By"): Debian 13 with .pgp, the role with .gpg.
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    name, content = DEBIAN_SOURCES[case]
    (apt / name if name == "sources.list" else apt / "sources.list.d" / name).write_text(content)
    install = yaml.safe_load((REPO / "roles" / "nvidia_driver" / "tasks" / "install.yml").read_text())
    tasks = [task for task in install if task.get("name") == KEYRING_TASK]
    nonfree = next(task for task in install if task.get("name") == "Add Debian's contrib and non-free components")
    play = TASK_PLAY.format(
        role="nvidia_driver",
        vars_file=REPO / "roles" / "nvidia_driver" / "vars" / "main.yml",
        task=json.dumps(tasks[0] if tasks else {"name": "No keyring look-up", "ansible.builtin.meta": "noop"}),
        play_vars=json.dumps({"test_signed_by": nonfree["ansible.builtin.deb822_repository"]["signed_by"]}),
        report="test_signed_by",
    )
    variables = {
        "report_file": str(tmp_path / "report.json"),
        "test_packages": {},
        "_nvidia_driver_apt_sources": [str(apt / "sources.list"), str(apt / "sources.list.d")],
        "nvidia_driver_debian_nonfree": True,
    }
    result = run_playbook(tmp_path, play, variables)
    assert result.returncode == 0, output_of(result)
    assert json.loads((tmp_path / "report.json").read_text()) == EXPECTED_KEYRING[case]


CUDA_REPORT = "{'toolkit_package': _cuda_toolkit_package, 'toolkit_source': _cuda_toolkit_source}"


CUDA_EXPECTED = {
    "debian-13": {"toolkit_package": "nvidia-cuda-toolkit", "toolkit_source": "distro"},
    "ubuntu-22.04": {"toolkit_package": "cuda-toolkit-12-4", "toolkit_source": "nvidia_repo"},
    "ubuntu-24.04": {"toolkit_package": "cuda-toolkit-12-4", "toolkit_source": "nvidia_repo"},
}


def test_cuda_toolkit_source_per_release(tmp_path):
    cases = {release: (release, {"cuda_toolkit_install": True}) for release in CUDA_EXPECTED}
    assert run_preflights(tmp_path, "cuda", cases, CUDA_REPORT) == CUDA_EXPECTED


def test_cuda_refuses_ubuntu_2404s_own_toolkit_for_cuda_12_4(tmp_path):
    play = ROLE_PLAY.format(role="cuda", report="{}")
    variables = {
        "test_facts": setup_facts("ubuntu-24.04"),
        "cuda_toolkit_install": True,
        "cuda_toolkit_source": "distro",
        "cuda_version": "11.8",
        "cuda_nccl_install": False,
    }
    result = run_playbook(tmp_path, play, variables, options=("--check", "--tags", "cuda_preflight"))
    output = output_of(result)
    assert result.returncode != 0, output
    assert "node7: cuda_version is 11.8 but Ubuntu 24.04's nvidia-cuda-toolkit is CUDA 12.0" in output, output


def test_docker_from_the_distribution_or_dockers_ubuntu_repository(tmp_path):
    report = "{'engine': _container_runtime_engine_packages, 'docker_repo': _container_runtime_docker_repo}"
    releases = ["ubuntu-22.04", "ubuntu-24.04"]
    cases = {release: (release, {"container_runtime_nvidia_toolkit": False}) for release in releases}
    decided = run_preflights(tmp_path, "container_runtime", cases, report)
    expected = {"engine": ["docker.io"], "docker_repo": "https://download.docker.com/linux/ubuntu"}
    assert decided == dict.fromkeys(releases, expected)
    for release in releases:
        assert apt_policy(release)["docker.io"]["candidate"], release


def test_python_env_refuses_a_wheelhouse_without_torch_for_the_nodes_python(tmp_path):
    # The wheelhouse holds torch for Python 3.11 only (the control node's): Debian 13's Python 3.13 cannot
    # install it, and pip would fail after the venv and the wheels were made. The preflight says so first.
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    (wheelhouse / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    play = ROLE_PLAY.format(role="python_env", report="{}")
    variables = {
        "test_facts": setup_facts("debian-13"),
        "python_env_wheelhouse": str(wheelhouse),
    }
    result = run_playbook(tmp_path, play, variables, options=("--check", "--tags", "python_env_preflight"))
    output = output_of(result)
    assert result.returncode != 0, output
    assert (
        f"node7: python_env_wheelhouse {wheelhouse} has no wheel for torch==2.13.0+cpu on Python 3.13"
        " (/usr/bin/python3 on the node): torch-2.13.0+cpu-cp313-*.whl" in output
    ), output


# The headers metapackage each release's archive has for a kernel of it (tests/fixtures/<release>/kernels.txt:
# Debian's captured from the archive's linux-image-* names, Ubuntu's written). Debian 12's 6.12 kernels have a
# series of their own; Ubuntu's newer series are HWE kernels.
HEADERS_EXPECTED = {
    "debian-12": {
        "6.1.0-57-amd64": "linux-headers-amd64",
        "6.1.0-57-rt-amd64": "linux-headers-rt-amd64",
        "6.12.118+deb12-cloud-amd64": "linux-headers-6.12-cloud-amd64",
    },
    "debian-13": {
        "6.12.117+deb13-amd64": "linux-headers-amd64",
        "6.12.117+deb13-cloud-amd64": "linux-headers-cloud-amd64",
    },
    "ubuntu-22.04": {
        "5.15.0-122-generic": "linux-headers-generic",
        "6.5.0-45-generic": "linux-headers-generic-hwe-22.04",
        "6.8.0-49-lowlatency": "linux-headers-lowlatency-hwe-22.04",
        "6.8.0-1015-aws": "linux-headers-aws",
    },
    "ubuntu-24.04": {
        "6.8.0-45-generic": "linux-headers-generic",
        "6.14.0-29-generic": "linux-headers-generic-hwe-24.04",
        "6.8.0-45-generic-64k": "linux-headers-generic-64k",
    },
}


def test_headers_metapackage_of_each_releases_kernels_is_in_its_archive(tmp_path):
    # One host per kernel flavour and series of each release (the newest of the listing), run as the role runs.
    cases = {}
    for release in HEADERS_EXPECTED:
        newest = {}
        for kernel in (FIXTURES / release / "kernels.txt").read_text().split():
            newest[re.sub(r"^(\d+\.\d+)\.\d+(-\d+|\+deb\d+)", r"\1", kernel)] = kernel
        for kernel in newest.values():
            cases[f"{release}_{kernel}"] = (release, {"test_facts": {**setup_facts(release), "kernel": kernel}})
    decided = run_preflights(tmp_path, "nvidia_driver", cases, "_nvidia_driver_headers")
    for host, (release, variables) in cases.items():
        kernel = variables["test_facts"]["kernel"]
        headers = decided[host]
        assert headers["note"] is None, host
        assert headers["packages"][0] == f"linux-headers-{kernel}", host
        metapackage = headers["packages"][1]
        assert HEADERS_EXPECTED[release].get(kernel, metapackage) == metapackage, host
        assert apt_policy(release).get(metapackage, {}).get("candidate"), f"{host}: {metapackage} is not in the archive"
    checked = {variables["test_facts"]["kernel"] for _release, variables in cases.values()}
    assert {kernel for expected in HEADERS_EXPECTED.values() for kernel in expected} <= checked
