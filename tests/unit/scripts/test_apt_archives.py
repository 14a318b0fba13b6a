"""molecule/resources/apt-archives: the test containers' apt archives, filled from one pool and kept
into it, so that a scenario does not download the packages an earlier one did."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _checkout(tmp_path: Path) -> Path:
    """A stand-in checkout holding the script where the molecule playbooks call it."""
    script = tmp_path / "molecule" / "resources" / "apt-archives"
    script.parent.mkdir(parents=True)
    shutil.copy2(ROOT / "molecule" / "resources" / "apt-archives", script)
    return script


def _run(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(script), *args], capture_output=True, text=True, timeout=30, check=False)


def test_what_one_container_downloaded_reaches_the_next_and_partial_files_do_not(tmp_path):
    script = _checkout(tmp_path)
    cache = tmp_path / ".cache" / "apt"
    assert _run(script, "fill", "a-node1", "a-node2").returncode == 0
    assert sorted(p.name for p in (cache / "nodes").iterdir()) == ["a-node1", "a-node2"]
    downloaded = cache / "nodes" / "a-node1" / "nftables_1.0.6-2+deb12u2_amd64.deb"
    downloaded.write_bytes(b"deb")
    (cache / "nodes" / "a-node1" / "partial").mkdir()
    (cache / "nodes" / "a-node1" / "partial" / "nginx_1.22.1-9_amd64.deb").write_bytes(b"half")

    assert _run(script, "keep", "a-node1", "a-node2").returncode == 0
    assert not (cache / "nodes" / "a-node1").exists() and not (cache / "nodes" / "a-node2").exists()
    assert sorted(p.name for p in (cache / "pool").iterdir()) == ["nftables_1.0.6-2+deb12u2_amd64.deb"]

    assert _run(script, "fill", "b-node1").returncode == 0
    linked = cache / "nodes" / "b-node1" / "nftables_1.0.6-2+deb12u2_amd64.deb"
    assert linked.read_bytes() == b"deb"
    # A hard link, not a copy: the pool costs its size once, whatever the number of containers.
    assert linked.stat().st_ino == (cache / "pool" / linked.name).stat().st_ino


def test_the_mount_is_the_containers_own_directory_and_a_bad_action_is_refused(tmp_path):
    script = _checkout(tmp_path)
    mount = _run(script, "mount", "a-node1")
    assert mount.stdout.strip() == f"{tmp_path.resolve()}/.cache/apt/nodes/a-node1:/var/cache/apt/archives"
    refused = _run(script, "clean", "a-node1")
    assert refused.returncode == 2 and "unknown action clean" in refused.stderr
    assert _run(script, "fill").returncode == 2  # no container named
