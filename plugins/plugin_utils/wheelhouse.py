"""The control node's wheelhouse (python_env_wheelhouse, filled by scripts/fill-wheelhouse): where it is,
and which of its wheels pip could take for a requirement. Wheel names and version specifiers are read by
``packaging`` (an ansible-core dependency), as pip reads them, so that preflight refuses what
``pip install --no-index --find-links`` would refuse on the node.

Controller-side and pure: paths and file names in, values out; the caller lists the folder.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable


def wheelhouse_folder(value: str, playbook_dir: str) -> str:
    """Return the wheelhouse's path on the control node: python_env_wheelhouse as python_env reads it, a
    relative path under the playbook's directory."""
    return posixpath.normpath(posixpath.join(playbook_dir, value))


def wheels_for(requirement: str, names: Iterable[str]) -> list[str]:
    """Return the wheel file names among names whose project and version satisfy requirement (``vllm``,
    ``vllm==0.11.0``). Python and platform tags and the wheel's own dependencies are not looked at:
    scripts/fill-wheelhouse downloads the dependencies with the package, for the Python it is given."""
    # Imported here, not at the top: ansible-core needs packaging at run time, but ansible-test's import
    # sanity test loads every plugin in an environment of jinja2 and PyYAML alone, and every filter that
    # imports plugin_utils.inference would fail it.
    from packaging.requirements import Requirement
    from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

    wanted = Requirement(requirement)
    project = canonicalize_name(wanted.name)
    found = []
    for name in names:
        try:
            wheel_project, version, _build, _tags = parse_wheel_filename(name)
        except InvalidWheelFilename:
            continue
        if wheel_project == project and wanted.specifier.contains(version, prereleases=True):
            found.append(name)
    return found
