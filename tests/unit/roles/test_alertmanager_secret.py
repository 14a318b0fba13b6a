"""Role alertmanager's config holds the receivers' secrets (the webhook URL, the SMTP password). Ansible moves
new content into place with the owner and mode the file already has (module_utils' atomic_move copies them
before its rename) and only then applies the task's: Debian's package ships the file world-readable, and a new
file is 0644 until that chmod. So the file must have its final owner and mode before the content lands."""

from __future__ import annotations

from pathlib import Path

import yaml

CONFIGURE = Path(__file__).resolve().parents[3] / "roles/alertmanager/tasks/configure.yml"


def test_the_config_has_its_final_owner_and_mode_before_the_secrets_are_written():
    tasks = yaml.safe_load(CONFIGURE.read_text())
    writes = [
        i for i, t in enumerate(tasks) if (t.get("ansible.builtin.template") or {}).get("src") == "alertmanager.yml.j2"
    ]
    assert len(writes) == 1, "one task writes alertmanager.yml"
    template = tasks[writes[0]]
    final = {key: template["ansible.builtin.template"][key] for key in ("owner", "group", "mode")}
    assert final == {"owner": "root", "group": "prometheus", "mode": "0640"}
    assert template.get("no_log") is True and template.get("diff") is False
    before = [
        t["ansible.builtin.file"]
        for t in tasks[: writes[0]]
        if (t.get("ansible.builtin.file") or {}).get("path") == template["ansible.builtin.template"]["dest"]
    ]
    assert before, "nothing gives alertmanager.yml its owner and mode before the secrets are written into it"
    prepared = before[-1]
    assert {key: prepared.get(key) for key in final} == final
    # Created empty when missing, never following a link, and its times kept (idempotent).
    assert prepared["state"] == "touch" and prepared["follow"] is False
    assert prepared["modification_time"] == prepared["access_time"] == "preserve"
