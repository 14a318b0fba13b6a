"""roles/torchrun/files/budgetgpu-job-record: root's records of a job (the energy counters at each start,
read through nvml_probe as gpu_facts reads them; the completed mark), written only in a directory of root's
own, by descriptor; and the bounded reader job_state=status runs on the job's files."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils import nvml_probe

REPO = Path(__file__).resolve().parents[3]
FINISHED = {"MONITOR_SERVICE_RESULT": "success", "MONITOR_EXIT_CODE": "exited", "MONITOR_EXIT_STATUS": "0"}

# A job user's racer: swaps every temporary file that appears in the directory for a link to the secret, for
# as long as it runs (the attack on a recorder that chmods by path between mkstemp and rename).
RACER = r"""
import os, sys
directory, secret = sys.argv[1], sys.argv[2]
link = os.path.join(directory, "..racer-link")
while True:
    for name in os.listdir(directory):
        if name.startswith(".") and name != "..racer-link":
            try:
                os.symlink(secret, link)
            except FileExistsError:
                pass
            try:
                os.replace(link, os.path.join(directory, name))
            except OSError:
                pass
"""


def load_recorder():
    from ansible_collections.budgetgpu.cluster.tests.unit.file_modules import load_file_module

    return load_file_module("budgetgpu_job_record", REPO / "roles" / "torchrun" / "files" / "budgetgpu-job-record")


@pytest.fixture
def records(tmp_path: Path) -> Path:
    path = tmp_path / "job-records" / "e2e"
    path.mkdir(parents=True)
    path.chmod(0o755)
    return path


def test_the_start_record_holds_each_gpus_counter_as_the_probe_reads_it(fake_pynvml, monkeypatch, records):
    nvml = fake_pynvml("rtx3090x4-risers")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    (records / "restart-pending").write_text("torchrun: restart pending\n")
    assert load_recorder().main(["start", str(records)]) == 0
    record = json.loads((records / "energy-start.json").read_text())
    probed = nvml_probe.probe_nvml(nvml)["gpus"]
    assert len(record["gpus"]) == 4
    for gpu in probed:
        # The counter grows with simulated time: the recorder read it a moment before the probe.
        assert 0 < record["gpus"][gpu["uuid"]] <= gpu["energy_total_j"]
    assert (records / "energy-start.json").stat().st_mode & 0o777 == 0o644
    assert not (records / "restart-pending").exists()
    assert sorted(p.name for p in records.iterdir()) == ["energy-start.json"]  # no temporary file left


def test_the_start_record_holds_the_cpus_joules_from_rapl(fake_pynvml, monkeypatch, records, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(None))
    recorder = load_recorder()
    state = tmp_path / "rapl-energy.json"
    monkeypatch.setattr(recorder.energy, "RAPL_STATE_FILE", str(state))
    # No reader on the node: no CPU in the record (job_state=status then estimates the CPU).
    assert recorder.main(["start", str(records)]) == 0
    assert "cpu" not in json.loads((records / "energy-start.json").read_text())
    state.write_text(json.dumps({"time": 1700000000.0, "joules": 5400.5, "zones": {"intel-rapl:0": {}}}))
    assert recorder.main(["start", str(records)]) == 0
    assert json.loads((records / "energy-start.json").read_text())["cpu"] == {"time": 1700000000.0, "joules": 5400.5}
    # A state that is not the reader's (a link, or no zone) records no CPU rather than a made-up one.
    state.unlink()
    state.symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text(json.dumps({"time": 1.0, "joules": 9.0, "zones": {"z": {}}}))
    assert recorder.main(["start", str(records)]) == 0
    assert "cpu" not in json.loads((records / "energy-start.json").read_text())


def test_no_nvml_records_no_gpu_and_never_stops_the_job(fake_pynvml, monkeypatch, records):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(None))
    assert load_recorder().main(["start", str(records)]) == 0
    assert json.loads((records / "energy-start.json").read_text())["gpus"] == {}


@pytest.mark.parametrize("kind", ["others-writable", "link"])
def test_a_record_directory_others_may_write_or_a_link_is_refused(fake_pynvml, monkeypatch, tmp_path, kind, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(None))
    target = tmp_path / "elsewhere"
    target.mkdir()
    if kind == "link":
        record_dir = tmp_path / "e2e"
        record_dir.symlink_to(target)
    else:
        record_dir = target
        target.chmod(0o777)
    recorder = load_recorder()
    assert recorder.main(["start", str(record_dir)]) == 1
    assert recorder.main(["finish", str(record_dir)], FINISHED) == 1
    assert list(target.iterdir()) == []
    assert str(record_dir) in capsys.readouterr().err


def test_the_recorder_never_chmods_a_racers_link(fake_pynvml, monkeypatch, records, tmp_path):
    """A job user swapping the temporary file for a link to a root-only file, again and again: the mode is set
    through the descriptor of the file the recorder created, so the secret's mode never changes. (The recorder
    of the release before chmodded by path and made the target 0644 in about one run of six.)"""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(None))
    secret = tmp_path / "shadow"
    secret.write_text("root:secret\n")
    secret.chmod(0o600)
    racer = subprocess.Popen([sys.executable, "-c", RACER, str(records), str(secret)])
    recorder = load_recorder()
    runs, deadline = 0, time.monotonic() + 4
    try:
        while runs < 200 or (runs < 2000 and time.monotonic() < deadline):
            recorder.main(["start", str(records)])
            runs += 1
            assert secret.stat().st_mode & 0o777 == 0o600, f"the secret was chmodded in run {runs}"
    finally:
        racer.kill()
        racer.wait()
    assert secret.read_text() == "root:secret\n"
    assert runs >= 200


def test_finish_writes_the_mark_only_when_systemd_says_the_job_ended_0(records):
    recorder = load_recorder()
    for result, code, status in (
        ("success", "killed", "TERM"),
        ("success", "exited", "143"),
        ("exit-code", "exited", "1"),
    ):
        env = {"MONITOR_SERVICE_RESULT": result, "MONITOR_EXIT_CODE": code, "MONITOR_EXIT_STATUS": status}
        assert recorder.main(["finish", str(records)], env) == 0
        assert not (records / "completed").exists(), env
    assert recorder.main(["finish", str(records)], FINISHED) == 0
    assert (records / "completed").is_file() and not (records / "completed").is_symlink()
    assert recorder.main(["finish", str(records)], FINISHED) == 0  # a second clean end keeps it


def test_finish_follows_no_completed_link(records, tmp_path):
    """A `completed` link planted where the mark goes (to /etc/nologin, say): replaced, never followed."""
    target = tmp_path / "nologin"
    (records / "completed").symlink_to(target)
    assert load_recorder().main(["finish", str(records)], FINISHED) == 0
    assert not target.exists()
    assert (records / "completed").is_file() and not (records / "completed").is_symlink()


def read(path: Path) -> dict:
    return load_recorder().read_bounded(str(path))


def test_the_reader_returns_a_regular_file_in_slurps_form(tmp_path):
    status = tmp_path / "status.json"
    status.write_text('{"step": 7}')
    assert json.loads(base64.b64decode(read(status)["content"])) == {"step": 7}
    assert read(tmp_path / "missing.json") == {}


def test_the_reader_refuses_links_fifos_devices_and_big_files(tmp_path):
    secret = tmp_path / "root-only"
    secret.write_text("SECRET")
    secret.chmod(0o600)
    cases = {"link to a root-only file": secret, "link to /dev/zero": Path("/dev/zero")}
    for name, target in cases.items():
        link = tmp_path / name.replace(" ", "-").replace("/", "")
        link.symlink_to(target)
        answer = read(link)
        assert "content" not in answer and "not read" in answer["error"], (name, answer)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    started = time.monotonic()
    assert "expected a regular file" in read(fifo)["error"]
    assert time.monotonic() - started < 1  # never waits for a writer
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (2 << 20))
    assert "more than 1048576 bytes" in read(big)["error"]


def test_the_reader_runs_as_a_program_with_an_isolated_python(tmp_path, node_python):
    status = tmp_path / "status.json"
    status.write_text("{}")
    script = REPO / "roles" / "torchrun" / "files" / "budgetgpu-job-record"
    out = subprocess.run(
        [node_python, "-I", str(script), "read", str(status)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    assert base64.b64decode(json.loads(out.stdout)["content"]) == b"{}"
