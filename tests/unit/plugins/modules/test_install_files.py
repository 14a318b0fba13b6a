"""budgetgpu.cluster.install_files through ansible-playbook on this machine (connection local, files
under tmp_path): creates, leaves alone, restores content and mode, check mode, bad input."""

from __future__ import annotations

import grp
import json
import os
import pwd
import stat
from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import output_of, run_playbook


def play(tmp_path: Path, *options: str, files: list[dict]) -> tuple[int, dict]:
    """Run one install_files task; return (exit status, the task's result)."""
    task = {
        "name": "Install",
        "budgetgpu.cluster.install_files": {
            "files": files,
            "owner": pwd.getpwuid(os.getuid()).pw_name,
            "group": grp.getgrgid(os.getgid()).gr_name,
        },
        "register": "out",
    }
    save = {"content": "{{ out | to_json }}", "dest": str(tmp_path / "out.json")}
    dump = {"name": "Save the result", "ansible.builtin.copy": save, "check_mode": False, "diff": False}
    done = run_playbook(tmp_path, json.dumps([{"hosts": "all", "gather_facts": False, "tasks": [task, dump]}]), {},
                        options=options)  # fmt: skip
    out = tmp_path / "out.json"
    result = json.loads(out.read_text()) if out.exists() else {"stdout": output_of(done)}
    out.unlink(missing_ok=True)
    return done.returncode, result


@pytest.fixture
def spec(tmp_path):
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "tool.sh").write_text("#!/bin/sh\necho tool\n")
    root = tmp_path / "node"
    return root, [
        {"src": str(tmp_path / "files" / "tool.sh"), "dest": str(root / "bin" / "tool"), "mode": "0755"},
        {"content": "KEY=value\n", "dest": str(root / "etc" / "sub" / "tool.env")},
    ]


def test_creates_files_and_parents_then_changes_nothing(tmp_path, spec):
    root, files = spec
    rc, result = play(tmp_path, files=files)
    assert rc == 0, result
    assert result["changed"] is True
    assert result["changed_files"] == [files[0]["dest"], files[1]["dest"]]
    assert result["created_directories"] == [str(root), str(root / "bin"), str(root / "etc"), str(root / "etc" / "sub")]
    assert (root / "bin" / "tool").read_text() == "#!/bin/sh\necho tool\n"
    assert stat.S_IMODE((root / "bin" / "tool").stat().st_mode) == 0o755
    assert stat.S_IMODE((root / "etc" / "sub" / "tool.env").stat().st_mode) == 0o644
    assert stat.S_IMODE((root / "etc").stat().st_mode) == 0o755

    rc, again = play(tmp_path, files=files)
    assert rc == 0 and again["changed"] is False and again["changed_files"] == []
    assert sorted(p.name for p in (root / "bin").iterdir()) == ["tool"]  # no temporary file left


def test_restores_edited_content_and_mode_and_shows_the_diff(tmp_path, spec):
    root, files = spec
    assert play(tmp_path, files=files)[0] == 0
    (root / "etc" / "sub" / "tool.env").write_text("KEY=edited by hand\n")
    (root / "bin" / "tool").chmod(0o600)
    rc, result = play(tmp_path, "--diff", files=files)
    assert rc == 0 and result["changed_files"] == [files[0]["dest"], files[1]["dest"]]
    assert (root / "etc" / "sub" / "tool.env").read_text() == "KEY=value\n"
    assert stat.S_IMODE((root / "bin" / "tool").stat().st_mode) == 0o755
    assert result["diff"] == [{"before_header": files[1]["dest"], "after_header": files[1]["dest"],
                               "before": "KEY=edited by hand\n", "after": "KEY=value\n"}]  # fmt: skip


def test_check_mode_reports_and_writes_nothing(tmp_path, spec):
    root, files = spec
    rc, result = play(tmp_path, "--check", files=files)
    assert rc == 0 and result["changed"] is True
    assert result["changed_files"] == [files[0]["dest"], files[1]["dest"]]
    assert not root.exists()


def test_a_script_gets_the_interpreter_on_its_first_line(tmp_path, spec):
    root, files = spec
    files[0]["interpreter"] = "/opt/budgetgpu/node/bin/python3 -I"
    assert play(tmp_path, files=files)[0] == 0
    assert (root / "bin" / "tool").read_text() == "#!/opt/budgetgpu/node/bin/python3 -I\necho tool\n"
    rc, result = play(tmp_path, files=files)
    assert (rc, result["changed"]) == (0, False)


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ([{"dest": "relative/path", "content": "x"}], "dest 'relative/path' is not an absolute path"),
        ([{"dest": "/tmp/budgetgpu-never", "src": "x", "content": "x"}], "give src or content, not both"),
        ([{"dest": "/tmp/budgetgpu-never"}], "/tmp/budgetgpu-never: give exactly one of src and content"),
        ([{"dest": "/tmp/budgetgpu-never", "src": "no-such-file"}], "cannot read src no-such-file"),
        (
            [{"dest": "/tmp/budgetgpu-never", "content": "KEY=value\n", "interpreter": "/usr/bin/python3 -I"}],
            "/tmp/budgetgpu-never: interpreter /usr/bin/python3 -I given, but the file has no #! line",
        ),
    ],
)
def test_bad_input_fails_with_the_file_named_and_writes_nothing(tmp_path, files, message):
    rc, result = play(tmp_path, files=files)
    assert rc == 2
    assert message in result["stdout"]
    assert not Path("/tmp/budgetgpu-never").exists()
