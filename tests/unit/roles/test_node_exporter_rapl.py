"""roles/node_exporter/files/budgetgpu-rapl, the root oneshot that reads RAPL: a fixture powercap tree
(there is none on the build machines), the counter's wrap between passes, the files it writes and the
state directories it refuses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
READER = REPO / "roles" / "node_exporter" / "files" / "budgetgpu-rapl"
TOP = 262143328850

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the reader accepts only a root-owned state directory")


@pytest.fixture
def installed(tmp_path):
    """The reader in a root-owned folder of its own, as the role installs it."""
    home = tmp_path / "opt"
    home.mkdir()
    shutil.copy(READER, home / "budgetgpu-rapl")
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    return home / "budgetgpu-rapl", state


def set_counter(root: Path, package_uj: int) -> None:
    for zone, name in (("intel-rapl:0", "package-0"), ("intel-rapl:0:0", "core")):
        directory = root / zone
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "name").write_text(name + "\n")
        (directory / "max_energy_range_uj").write_text(f"{TOP}\n")
        counter = directory / "energy_uj"
        counter.write_text(f"{package_uj}\n")
        counter.chmod(0o400)  # as the kernel has it since the Platypus fix


@pytest.fixture
def run(node_python):
    """Run the reader as its unit does: the node venv's python, isolated."""

    def reader_run(reader: Path, state: Path, root: Path, *extra: str) -> subprocess.CompletedProcess:
        argv = [node_python, "-I", str(reader), "--powercap-root", str(root), "--state-dir", str(state), *extra]
        return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)

    return reader_run


def values(path: Path) -> dict[str, float]:
    """{'name{labels}': value} of the textfile, by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        sample.name + "".join(f'{{{k}="{v}"}}' for k, v in sample.labels.items()): sample.value
        for family in text_string_to_metric_families(path.read_text())
        for sample in family.samples
    }


def test_passes_count_across_the_wrap_and_write_the_textfile(installed, tmp_path, run):
    reader, state = installed
    root = tmp_path / "powercap"
    set_counter(root, TOP - 4_000_000)
    assert run(reader, state, root, "--base-watts", "180").returncode == 0
    set_counter(root, 6_000_000)  # wrapped: 4 J before max_energy_range_uj, 6 J after
    done = run(reader, state, root, "--base-watts", "180")
    assert done.returncode == 0, done.stderr
    saved = json.loads((state / "energy.json").read_text())
    assert saved["joules"] == pytest.approx(10) and list(saved["zones"]) == ["intel-rapl:0"]
    found = values(state / "rapl.prom")
    assert found['budgetgpu_node_cpu_energy_joules_total{zone="package-0"}'] == pytest.approx(10)
    assert found["budgetgpu_node_base_watts"] == 180
    assert "# TYPE budgetgpu_node_cpu_energy_joules_total counter" in (state / "rapl.prom").read_text()
    for name in ("energy.json", "rapl.prom"):
        assert (state / name).stat().st_mode & 0o777 == 0o644, "node exporter and the summary read them"
    assert sorted(p.name for p in state.iterdir()) == ["energy.json", "rapl.prom"], "no temporary file left"


def test_a_node_without_rapl_exports_the_estimate_only(installed, tmp_path, run):
    reader, state = installed
    done = run(reader, state, tmp_path / "no-powercap")
    assert done.returncode == 0
    assert "no RAPL zone" in done.stdout
    found = values(state / "rapl.prom")
    assert found["budgetgpu_node_cpu_energy_zones"] == 0 and found["budgetgpu_node_base_watts"] == 200


def test_a_state_directory_others_may_write_or_a_link_is_refused(installed, tmp_path, run):
    reader, state = installed
    root = tmp_path / "powercap"
    set_counter(root, 1)
    state.chmod(0o777)
    done = run(reader, state, root)
    assert done.returncode == 1 and "expected root's, writable by root only" in done.stderr
    assert not (state / "energy.json").exists()
    state.chmod(0o755)
    link = tmp_path / "link"
    link.symlink_to(state)
    assert run(reader, link, root).returncode == 1


def test_a_planted_link_in_place_of_the_state_is_not_followed(installed, tmp_path, run):
    reader, state = installed
    root = tmp_path / "powercap"
    set_counter(root, 1)
    target = tmp_path / "elsewhere"
    target.write_text("keep\n")
    (state / "energy.json").symlink_to(target)
    (state / ".rapl.prom.tmp").symlink_to(target)
    assert run(reader, state, root).returncode == 0
    assert target.read_text() == "keep\n"
    assert not (state / "energy.json").is_symlink()
