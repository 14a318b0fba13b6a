"""No role reads another role's files, nor goes up out of its own folder (issue 41).

What belongs to the collection rather than to one role a role reaches by name (lookup
budgetgpu.cluster.collection_files: the node package, the nightly script); what two roles share is a
private role of its own that both include (_trusted_venv, _firewall). Role READMEs are prose and not read.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# role_path ~ '/../python_env/files/x', "{{ role_path }}/../../scripts/x"
UP_FROM_ROLE = re.compile(r"role_path\s*(~\s*['\"]|\}\}\s*)/\.\.")


def crossings(repo: Path) -> list[str]:
    """path:line of each place in a role's files that leaves the role's folder."""
    roles = sorted(path.name for path in (repo / "roles").iterdir() if path.is_dir())
    other_role = re.compile(r"\.\./(" + "|".join(map(re.escape, roles)) + r")/")
    found = []
    for path in sorted((repo / "roles").rglob("*")):
        if not path.is_file() or path.suffix in (".md", ".pyc"):
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            if UP_FROM_ROLE.search(line) or other_role.search(line):
                found.append(f"{path.relative_to(repo)}:{number}: {line.strip()}")
    return found


def test_no_role_reads_another_roles_files_or_leaves_its_folder():
    found = crossings(REPO)
    assert not found, "roles that reach out of their folder:\n" + "\n".join(found)


def test_the_check_sees_each_way_out(tmp_path):
    tasks = tmp_path / "roles" / "a" / "tasks"
    tasks.mkdir(parents=True)
    (tmp_path / "roles" / "b" / "files").mkdir(parents=True)
    (tasks / "main.yml").write_text(
        "- x: \"{{ lookup('ansible.builtin.file', role_path ~ '/../b/files/venv_state.py') }}\"\n"
        '- src: "{{ role_path }}/../../scripts/gpu-probe"\n'
        "- x: \"{{ query('ansible.builtin.fileglob', role_path ~ '/../../plugins/module_utils/*.py') }}\"\n"
        "- src: ../b/files/requirements.txt\n"
        '- src: "{{ role_path }}/files/own.py"\n'
        "- x: \"{{ query('budgetgpu.cluster.collection_files', 'plugins/module_utils/*.py') }}\"\n"
    )
    (tmp_path / "roles" / "a" / "README.md").write_text("role_path ~ '/../b/' in prose\n")
    assert [line.split(":")[1] for line in crossings(tmp_path)] == ["1", "2", "3", "4"]
