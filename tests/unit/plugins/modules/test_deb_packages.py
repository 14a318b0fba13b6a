"""deb_packages: dpkg-query output parsing, version and glob matching, missing and held lists, and the
module run against a fake dpkg-query on PATH (never the host's package database)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import yaml
from ansible.module_utils.testing import patch_module_args
from ansible_collections.budgetgpu.cluster.plugins.modules import deb_packages
from ansible_collections.budgetgpu.cluster.plugins.modules.deb_packages import (
    parse_dpkg_query,
    parse_spec,
    unsatisfied,
)
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import output_of, run_playbook

# What `dpkg-query -W -f "${Package}\t${Architecture}\t${Version}\t${db:Status-Abbrev}\n"` prints:
# the status abbrev is three letters (selection, status, error flag), here ending in a space.
DPKG_OUTPUT = (
    "bash\tamd64\t5.2.15-2+b8\tii \n"
    "docker-ce\tamd64\t5:27.3.1-1~debian.12~bookworm\tii \n"
    "libnccl2\tamd64\t2.21.5-1+cuda12.4\thi \n"  # held and installed
    "nvidia-driver\tamd64\t535.183.01-1\trc \n"  # removed, configuration files left
    "libfoo\tamd64\t1.0-1\tiH \n"  # half-installed
    "libbar\tamd64\t2.0-1\tiF \n"  # half-configured
    "libnccl-dev\tamd64\t2.21.5-1+cuda12.4\thn \n"  # held, not installed
    "libbz2\t\t\tun \n"  # known to dpkg (a virtual package), not installed: no version, no architecture
)


# -- parsing -----------------------------------------------------------------------------


def test_parse_dpkg_query_reads_each_line_under_its_name_and_name_with_arch():
    packages = parse_dpkg_query(DPKG_OUTPUT)
    assert packages["bash"] == packages["bash:amd64"] == ("5.2.15-2+b8", "ii ")
    assert packages["libnccl2"] == ("2.21.5-1+cuda12.4", "hi ")
    assert packages["nvidia-driver"] == ("535.183.01-1", "rc ")
    assert packages["libbz2"] == ("", "un ")
    assert "libbz2:" not in packages and "nosuchpkg" not in packages


def test_parse_dpkg_query_ignores_blank_and_malformed_lines():
    assert parse_dpkg_query("\n\tamd64\t1\tii \nbash 5.2 ii\nbash\tamd64\t5.2\tii \n") == {
        "bash": ("5.2", "ii "),
        "bash:amd64": ("5.2", "ii "),
    }


def test_parse_dpkg_query_prefers_an_installed_architecture_for_the_bare_name():
    packages = parse_dpkg_query("libc6\ti386\t2.36-8\trc \nlibc6\tamd64\t2.36-9\tii \nlibc6\tarm64\t2.36-7\tii \n")
    assert packages["libc6"] == ("2.36-9", "ii ")  # the first installed one, not the removed i386
    assert packages["libc6:i386"] == ("2.36-8", "rc ")
    assert packages["libc6:arm64"] == ("2.36-7", "ii ")


# -- specs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [
        ("bash", ("bash", None)),
        ("libfoo:amd64", ("libfoo:amd64", None)),
        ("libnccl2=2.21.5-1+cuda12.4", ("libnccl2", "2.21.5-1+cuda12.4")),
        ("docker-ce=5:27.3*", ("docker-ce", "5:27.3*")),
        ("libc6:amd64=2.36-9", ("libc6:amd64", "2.36-9")),
    ],
)
def test_parse_spec_accepts_apt_style_specs(spec, parsed):
    assert parse_spec(spec) == parsed


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("", "'' has no package name"),
        ("=1.0", "'=1.0' has no package name"),
        ("bash=", "'bash=' is not name, name=version or name=version-glob"),
        ("bash=1=2", "'bash=1=2' is not name, name=version or name=version-glob"),
        ("nvidia-*", "'nvidia-*': 'nvidia-*' is not a package name"),
        ("bash>=5", "'bash>=5': 'bash>' is not a package name"),
        ("-x", "'-x': '-x' is not a package name"),
    ],
)
def test_parse_spec_rejects_a_bad_spec_naming_it(spec, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        parse_spec(spec)


# -- what is missing ---------------------------------------------------------------------


def test_installed_and_held_installed_are_satisfied_the_rest_missing():
    specs = ["bash", "libnccl2", "nvidia-driver", "libfoo", "libbar", "libnccl-dev", "libbz2", "nosuchpkg"]
    result = unsatisfied(specs, parse_dpkg_query(DPKG_OUTPUT))
    assert result["installed"] == {"bash": "5.2.15-2+b8", "libnccl2": "2.21.5-1+cuda12.4"}
    assert result["missing"] == ["nvidia-driver", "libfoo", "libbar", "libnccl-dev", "libbz2", "nosuchpkg"]


@pytest.mark.parametrize(
    ("spec", "is_missing"),
    [
        ("libnccl2=2.21.5-1+cuda12.4", False),  # exact
        ("libnccl2=2.21.5-1+cuda12.6", True),  # another version
        ("bash=5.2", True),  # without a glob a version is exact, not a prefix
        ("docker-ce=5:27.3*", False),  # glob, as apt takes it
        ("docker-ce=5:27.*~debian.12~*", False),
        ("docker-ce=5:27.4*", True),
        ("docker-ce=27.3*", True),  # the epoch is part of the version
        ("nvidia-driver=535.183.01-1", True),  # the version of a removed package does not count
    ],
)
def test_versions_match_exactly_or_by_glob(spec, is_missing):
    result = unsatisfied([spec], parse_dpkg_query(DPKG_OUTPUT))
    assert result["missing"] == ([spec] if is_missing else [])


def test_installed_reports_the_installed_version_even_when_another_is_asked():
    result = unsatisfied(["docker-ce=5:27.4*"], parse_dpkg_query(DPKG_OUTPUT))
    assert result["installed"] == {"docker-ce": "5:27.3.1-1~debian.12~bookworm"}


def test_missing_keeps_the_given_order_without_repeats():
    specs = ["nosuch-b", "bash", "nosuch-a", "nosuch-b", "libfoo", "nosuch-a", "libfoo=1.0-1"]
    assert unsatisfied(specs, parse_dpkg_query(DPKG_OUTPUT))["missing"] == [
        "nosuch-b",
        "nosuch-a",
        "libfoo",
        "libfoo=1.0-1",
    ]


def test_held_lists_the_asked_held_names_sorted_installed_or_not():
    specs = ["libnccl2=2.21.5-1+cuda12.4", "libnccl-dev", "bash", "nosuchpkg"]
    result = unsatisfied(specs, parse_dpkg_query(DPKG_OUTPUT))
    assert result["held"] == ["libnccl-dev", "libnccl2"]
    assert unsatisfied(["bash"], parse_dpkg_query(DPKG_OUTPUT))["held"] == []


def test_arch_qualified_names_match_their_architecture_only():
    packages = parse_dpkg_query("libc6\tamd64\t2.36-9\tii \n")
    result = unsatisfied(["libc6:amd64", "libc6:i386", "libc6"], packages)
    assert result["installed"] == {"libc6:amd64": "2.36-9", "libc6": "2.36-9"}
    assert result["missing"] == ["libc6:i386"]


# -- the module --------------------------------------------------------------------------


def run(args, capsys):
    """Run deb_packages' main() with args; return (exit code, result)."""
    with patch_module_args(args), pytest.raises(SystemExit) as info:
        deb_packages.main()
    return info.value.code, json.loads(capsys.readouterr().out)


@pytest.fixture
def fake_dpkg_query(tmp_path, monkeypatch):
    """Put a dpkg-query on PATH that prints `stdout` and `stderr` and exits `rc`; return the file
    where it writes its arguments, each ended by a NUL (absent when it was not run)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    argv = tmp_path / "dpkg-query.argv"

    def install(stdout: str = "", stderr: str = "", rc: int = 0) -> Path:
        (tmp_path / "dpkg-query.out").write_text(stdout)
        (tmp_path / "dpkg-query.err").write_text(stderr)
        script = bin_dir / "dpkg-query"
        script.write_text(
            f'#!/bin/sh\nprintf "%s\\0" "$@" > {argv}\n'
            f"cat {tmp_path / 'dpkg-query.out'}\ncat {tmp_path / 'dpkg-query.err'} >&2\nexit {rc}\n"
        )
        script.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
        return argv

    return install


def test_module_queries_once_and_reports_the_known_packages_when_some_are_unknown(fake_dpkg_query, capsys):
    argv = fake_dpkg_query(DPKG_OUTPUT, "dpkg-query: no packages found matching nosuchpkg\n", rc=1)
    names = ["bash", "libnccl2=2.21.5-1+cuda12.4", "nosuchpkg", "bash", "docker-ce=5:27.4*"]
    code, result = run({"names": names, "_ansible_check_mode": True}, capsys)
    assert code == 0, result
    assert argv.read_text().split("\0")[:-1] == [
        "-W",
        "-f",
        "${Package}\t${Architecture}\t${Version}\t${db:Status-Abbrev}\n",
        "--",
        "bash",
        "libnccl2",
        "nosuchpkg",
        "docker-ce",
    ]
    assert result["changed"] is False
    assert result["installed"] == {
        "bash": "5.2.15-2+b8",
        "libnccl2": "2.21.5-1+cuda12.4",
        "docker-ce": "5:27.3.1-1~debian.12~bookworm",
    }
    assert result["missing"] == ["nosuchpkg", "docker-ce=5:27.4*"]
    assert result["held"] == ["libnccl2"]


def test_module_fails_on_another_dpkg_query_error_with_its_stderr(fake_dpkg_query, capsys):
    fake_dpkg_query("", "dpkg-query: error: parsing file '/var/lib/dpkg/status' near line 7\n", rc=2)
    code, result = run({"names": ["bash"]}, capsys)
    assert code == 1 and result["failed"] is True
    assert result["msg"].startswith("deb_packages: dpkg-query failed (rc 2): dpkg-query: error: parsing file")
    assert "needs a Debian or Ubuntu node" in result["msg"]
    assert result["rc"] == 2 and "near line 7" in result["stderr"]


def test_module_without_dpkg_query_says_it_needs_debian(monkeypatch, capsys):
    monkeypatch.setattr(deb_packages.AnsibleModule, "get_bin_path", lambda self, name, *a, **k: None)
    code, result = run({"names": ["bash"]}, capsys)
    assert code == 1
    assert result["msg"] == "deb_packages: dpkg-query not found: this module needs a Debian or Ubuntu node"


def test_module_rejects_bad_specs_naming_them_before_running_dpkg_query(fake_dpkg_query, capsys):
    argv = fake_dpkg_query(DPKG_OUTPUT)
    code, result = run({"names": ["bash", "", "nvidia-*", "docker-ce=5=27"]}, capsys)
    assert code == 1
    assert result["msg"] == (
        "deb_packages: '' has no package name; "
        "'nvidia-*': 'nvidia-*' is not a package name (globs in the name are not supported); "
        "'docker-ce=5=27' is not name, name=version or name=version-glob"
    )
    assert not argv.exists()


def test_module_with_no_names_does_not_list_every_package(fake_dpkg_query, capsys):
    argv = fake_dpkg_query(DPKG_OUTPUT)
    code, result = run({"names": []}, capsys)
    assert code == 0
    assert (result["installed"], result["missing"], result["held"]) == ({}, [], [])
    assert not argv.exists()


def test_module_through_ansible_playbook_in_check_mode(tmp_path, fake_dpkg_query):
    fake_dpkg_query(DPKG_OUTPUT, "dpkg-query: no packages found matching nosuchpkg\n", rc=1)
    task = {"budgetgpu.cluster.deb_packages": {"names": ["bash", "nosuchpkg"]}, "register": "out"}
    show = {"ansible.builtin.debug": {"msg": "RESULT {{ out.missing | join(',') }} {{ out.changed }}"}}
    done = run_playbook(tmp_path, json.dumps([{"hosts": "all", "gather_facts": False, "tasks": [task, show]}]), {},
                        options=("--check",))  # fmt: skip
    assert done.returncode == 0, output_of(done)
    assert "RESULT nosuchpkg False" in output_of(done)


# -- documentation -----------------------------------------------------------------------


def test_every_option_is_documented_and_every_returned_key_has_a_sample():
    docs = {}
    for node in ast.parse(Path(deb_packages.__file__).read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") in ("DOCUMENTATION", "RETURN"):
            docs[node.targets[0].id] = yaml.safe_load(node.value.value)
    with patch_module_args({"names": []}):
        module = deb_packages.build_module()
    assert set(module.argument_spec) == set(docs["DOCUMENTATION"]["options"])
    assert all("sample" in spec for spec in docs["RETURN"].values())
