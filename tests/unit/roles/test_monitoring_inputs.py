"""The cluster-wide inputs budgetgpu_node_exporter_port and budgetgpu_node_exporter_textfile_dir: every
role that reads them (node_exporter listens and collects, prometheus scrapes, gpu_health links its
metrics) falls back to the same default, plugin_utils/monitoring.py's, and no role has a setting of its
own for them any more."""

from __future__ import annotations

import re
from pathlib import Path

from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import monitoring

ROLES = Path(__file__).resolve().parents[3] / "roles"
DEFAULT = re.compile(r"(budgetgpu_node_exporter_port|budgetgpu_node_exporter_textfile_dir) \| default\(([^)]*)\)")


def test_every_role_reads_the_inputs_with_monitorings_defaults():
    seen: dict[str, set[str]] = {}
    for path in ROLES.glob("*/*/*.yml"):
        for name, default in DEFAULT.findall(path.read_text()):
            assert default.strip("'\"") == str(
                {"budgetgpu_node_exporter_port": monitoring.NODE_EXPORTER_PORT}.get(name, monitoring.TEXTFILE_DIR)
            ), f"{path}: {name} | default({default})"
            seen.setdefault(name, set()).add(path.parts[-3])
    assert seen == {
        "budgetgpu_node_exporter_port": {"node_exporter", "prometheus"},
        "budgetgpu_node_exporter_textfile_dir": {"node_exporter", "gpu_health"},
    }


def test_no_role_keeps_a_setting_of_its_own_for_them():
    old = re.compile(
        r"\b(?<!_)(node_exporter_port|prometheus_node_exporter_port|node_exporter_textfile_dir|gpu_health_textfile_dir)\b"
    )
    for path in [*ROLES.glob("*/*/*.yml"), *ROLES.glob("*/templates/*.j2")]:
        assert not old.search(path.read_text()), path
