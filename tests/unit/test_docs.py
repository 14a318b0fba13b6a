"""The docs hold together: each role variable is described once, in its role's meta/argument_specs.yml
(`ansible-doc -t role budgetgpu.cluster.<role>` renders it; scripts/check-docs checks that it does), so a
role's README links there and holds no table of variables; and every relative link in the READMEs,
CONTRIBUTING.md and docs/ points at a file (and a heading) that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ROLES = sorted(path.parents[1] for path in REPO.glob("roles/*/meta/argument_specs.yml"))
PAGES = sorted(
    [REPO / "README.md", REPO / "CONTRIBUTING.md", *REPO.glob("docs/**/*.md"), *REPO.glob("roles/*/README.md")]
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
# A table row whose first cell starts with a name in backticks: | `name` ... |
ROW_NAME = re.compile(r"^\|\s*`([\w.]+)`", re.MULTILINE)


def option_names(options: dict | None) -> set[str]:
    """Every option of an argument spec, nested ones (a job's keys) included."""
    names = set()
    for name, spec in (options or {}).items():
        names.add(name)
        names |= option_names((spec or {}).get("options"))
    return names


def role_options(role: Path) -> set[str]:
    specs = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    return set().union(*(option_names(entry.get("options")) for entry in specs.values()))


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path, _hash, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        missing_heading = anchor and resolved.suffix == ".md" and anchor not in anchors(resolved)
        if not resolved.exists() or missing_heading:
            broken.append(target)
    return broken


@pytest.mark.parametrize("role", ROLES, ids=lambda role: role.name)
def test_a_role_readme_links_to_its_argument_spec_and_holds_no_variable_table(role):
    readme = (role / "README.md").read_text()
    assert f"ansible-doc -t role budgetgpu.cluster.{role.name}" in readme
    tabled = sorted(set(ROW_NAME.findall(readme)) & role_options(role))
    assert not tabled, (
        f"roles/{role.name}/README.md describes variables in a table (say it in the argument spec): {tabled}"
    )


@pytest.mark.parametrize("role", ROLES, ids=lambda role: role.name)
def test_every_variable_of_a_role_is_described_in_its_argument_spec(role):
    specs = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    options = {}
    for entry in specs.values():
        options |= entry.get("options") or {}
    defaults_file = role / "defaults" / "main.yml"
    defaults = yaml.safe_load(defaults_file.read_text()) if defaults_file.exists() else {}
    assert not set(defaults or {}) - set(options), "defaults without an argument spec"
    assert [name for name, spec in options.items() if not spec.get("description")] == []


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_relative_link_points_at_a_file_that_exists(page):
    assert broken_links(page) == []


def test_the_checks_see_what_they_must(tmp_path):
    # A variable table and a job key's row are found; a table of alerts or of a profile's keys is not one.
    torchrun = REPO / "roles" / "torchrun"
    assert {"torchrun_jobs", "gradient_compression"} <= role_options(torchrun)
    table = (
        "| variable | default |\n| --- | --- |\n| `torchrun_venv` | x |\n| `port` | 1 |\n| `BudgetgpuGpuLost` | y |\n"
    )
    assert set(ROW_NAME.findall(table)) & role_options(torchrun) == {"torchrun_venv", "port"}
    # A link to a missing file or heading is broken; one inside a code block, to a URL or to a real heading is not.
    (tmp_path / "there.md").write_text("# A heading, with punctuation\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[a](there.md) [b](there.md#a-heading-with-punctuation) [c](https://example.org/x) [d](#title)\n"
        "# Title\n[e](missing.md) [f](there.md#nowhere)\n```\n[g](also-missing.md)\n```\n"
    )
    assert broken_links(page) == ["missing.md", "there.md#nowhere"]
