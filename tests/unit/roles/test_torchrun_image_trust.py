"""The job user's ways in through an image job (issue 44 item 2), tried where root's tasks and the job's unit
decide them: a planted image tag, a mount of another path, an environment aimed at root. The job's user has
no engine (test_torchrun_engine_users.py); what root runs and what systemd binds as root is rendered here.
"""

from __future__ import annotations

import posixpath
import re

import jinja2
import pytest
import yaml
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import (
    image_bads,
    job_image,
    torchrun_jobs_normalize,
    torchrun_plan,
)
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import REPO, render_job_units

HEX = "ab" * 32
TAGGED = f"registry.lan:5000/team/train:v1@sha256:{HEX}"
STATE_DIR = "/var/lib/budgetgpu/jobs/main"
# An Exec line whose prefixes hold "+", "!" or "!!": it runs as root with the unit's environment.
ROOT_LINE = re.compile(r"^Exec\w+=[-@:|]*(\+|!)", re.MULTILINE)


def plan_image(image) -> dict:
    (job,) = torchrun_plan(
        torchrun_jobs_normalize(
            [{"name": "main", "script": "/srv/train.py", "nodes": "all", "nproc_per_node": 1, "image": image}]
        ),
        "node7",
        {"all": ["node7"]},
        {"node7": {}},
        "/opt/budgetgpu/bin/budgetgpu-torchrun",
    )
    return job["image"]


# An image job whose work and checkpoint directories lie in its state directory.
STATE_JOB = torchrun_jobs_normalize(
    [
        {
            "name": "main",
            "script": "/srv/train.py",
            "image": TAGGED,
            "workdir": f"{STATE_DIR}/work",
            "checkpoint_dir": f"{STATE_DIR}/work/ckpt",
        }
    ]
)[0]
# torchrun_hardening and torchrun_sandbox as loose as they go, for a job whose image holds a setuid file.
LOOSE_HARDENING = {
    "torchrun_sandbox": False,
    "torchrun_hardening": {
        "NoNewPrivileges": "no",
        "RestrictSUIDSGID": "no",
        "CapabilityBoundingSet": "CAP_SETUID",
        "AmbientCapabilities": "CAP_SETUID",
    },
}


@pytest.fixture(scope="module")
def units(tmp_path_factory) -> dict[str, str]:
    """The units these tests read, rendered in one run: tagged, a job whose image is named with a tag beside its
    digest; state, STATE_JOB's; loose, the tagged job's under LOOSE_HARDENING."""
    state = {key: STATE_JOB[key] for key in ("workdir", "checkpoint_dir", "state_dir")}
    tagged = {"test_job": {"image": plan_image(TAGGED)}}
    files = render_job_units(
        tmp_path_factory.mktemp("units"),
        {
            "tagged": tagged,
            "state": {"test_job": {**state, "image": job_image(STATE_JOB)}},
            "loose": {**tagged, **LOOSE_HARDENING},
        },
    )
    return {name: path.read_text() for name, path in files.items()}


@pytest.fixture(scope="module")
def tagged_unit(units) -> str:
    return units["tagged"]


def roots_image_commands(image: dict) -> list[str]:
    """Every command, path and argv of images.yml's tasks (root's, on the node) rendered for one image: item is
    the image in the loops over the images, item.item (item.item.item) in those over registered results."""
    environment = jinja2.Environment(undefined=jinja2.StrictUndefined)
    environment.filters["dirname"] = posixpath.dirname
    item = {**image, "item": {**image, "item": image}}
    rendered = []
    for task in yaml.safe_load((REPO / "roles/torchrun/tasks/images.yml").read_text()):
        for module in (
            "ansible.builtin.command",
            "ansible.builtin.shell",
            "ansible.builtin.file",
            "ansible.builtin.copy",
        ):
            args = task.get(module) or {}
            for key in ("argv", "cmd", "path", "dest", "creates"):
                value = args.get(key)
                # The directories' task loops over (path, mode) pairs of the images' roots, not over images.
                if value and "item.0" not in str(value):
                    texts = value if isinstance(value, list) else [value]
                    rendered.append(" ".join(environment.from_string(str(text)).render(item=item) for text in texts))
    return rendered


# (a) A planted tag. The job user has no engine to retag with; still, what root pulls, inspects and unpacks,
# and the unit's root, are named by the digest alone: a tag beside it is dropped.
def test_roots_image_commands_and_the_units_root_name_the_digest_and_no_tag(tagged_unit):
    image = plan_image(TAGGED)
    assert image["ref"] == f"registry.lan:5000/team/train@sha256:{HEX}"
    commands = roots_image_commands(image)
    docker = [command for command in commands if "docker" in command]
    # inspect, pull (or load), inspect again, create and export: each names the image by its digest.
    assert len(docker) == 4, docker
    for command in docker:
        assert f"registry.lan:5000/team/train@sha256:{HEX}" in command, command
    for command in commands:
        assert ":v1" not in command, command
    assert f"RootDirectory=/var/lib/budgetgpu/images/{HEX}/rootfs" in tagged_unit.splitlines()
    assert f"EnvironmentFile=/var/lib/budgetgpu/images/{HEX}/env" in tagged_unit.splitlines()
    assert ":v1" not in tagged_unit


def test_a_tarballs_image_is_named_by_its_id_alone():
    image = plan_image({"tarball": "/srv/images/train.tar", "digest": f"sha256:{HEX}"})
    assert image["ref"] == f"sha256:{HEX}"
    inspect, load, inspect_again, unpack = [command for command in roots_image_commands(image) if "docker" in command]
    assert inspect == inspect_again == f"docker image inspect sha256:{HEX}"
    assert load == f"['docker', 'load', '--input', '/var/lib/budgetgpu/images/{HEX}/image.tar']"
    assert f'docker create --network none "sha256:{HEX}"' in unpack


# (b) A mount of another path. systemd resolves a bind's source as root, following links: a bound directory
# whose parent the job's user may write (its state directory, its home) could become a link to a place only
# root reaches (another image's files behind root's 0700 directory). Only the state directory is bound; its
# parents are root's.
@pytest.mark.parametrize(
    ("field", "path"),
    [
        ("checkpoint_dir", "/home/alice/ckpt"),
        ("workdir", "/srv/work"),
        ("checkpoint_dir", f"{STATE_DIR}/../other/checkpoints"),
        ("workdir", f"{STATE_DIR}-other"),
    ],
)
def test_an_image_job_with_a_directory_outside_its_state_directory_is_refused(field, path):
    job = {"name": "main", "script": "/srv/train.py", "image": TAGGED, field: path}
    # A workdir outside also takes the default checkpoint_dir (<workdir>/checkpoints) out with it.
    bads = {bad[0]: bad[:3] for bad in image_bads(torchrun_jobs_normalize([job])[0])}
    assert bads[field] == (field, path, f"{STATE_DIR} or a directory in it, for an image job")
    with pytest.raises(ValueError, match=f"job main: {field}: found '{re.escape(path)}'"):
        job_image(torchrun_jobs_normalize([job])[0])
    # A venv job's unit binds nothing: its directories are where the inventory says.
    assert not list(image_bads(torchrun_jobs_normalize([{**job, "image": None}])[0]))


def test_an_image_unit_binds_and_opens_only_the_state_directory(units):
    assert not list(image_bads(STATE_JOB))
    unit = units["state"].splitlines()
    assert [line for line in unit if line.startswith(("BindPaths=", "ReadWritePaths="))] == [
        f"ReadWritePaths=-{STATE_DIR}",
        f"BindPaths={STATE_DIR}",
    ]
    # What else the unit binds is root's (the launcher, the node package, name resolution, the driver): no
    # directory of the job's.
    for line in unit:
        if line.startswith("BindReadOnlyPaths="):
            assert "/var/lib/budgetgpu/jobs" not in line, line


# A setuid file of the image (su, sudo, one its author left): no privilege gained in the unit, whatever
# torchrun_hardening says (the host's own setuid files are its admin's choice; an image's are not).
def test_an_image_units_job_gains_no_privilege_whatever_the_hardening_says(units):
    unit = units["loose"]
    values = {line.split("=", 1)[0]: line.split("=", 1)[1] for line in unit.splitlines() if "=" in line}
    assert [values[key] for key in ("NoNewPrivileges", "RestrictSUIDSGID", "CapabilityBoundingSet")] == [
        "yes",
        "yes",
        "",
    ]
    assert values["AmbientCapabilities"] == ""


# (c) An environment aimed at root. The job's environment (LD_PRELOAD, PATH, PYTHONPATH) and the image's are
# read by the job's unit alone, which runs as the job's user with no root line; root's image tasks run with
# Ansible's environment and write the image's Config.Env into a file as data.
def test_the_jobs_and_the_images_environment_reach_only_the_jobs_unit(tagged_unit):
    unit = tagged_unit
    assert ROOT_LINE.findall(unit) == []
    assert [line for line in unit.splitlines() if line.startswith("User=")] == ["User=budgetgpu"]
    assert not [line for line in unit.splitlines() if line.startswith("PassEnvironment=")]
    assert [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("EnvironmentFile=")] == [
        f"/var/lib/budgetgpu/images/{HEX}/env",
        "-/etc/budgetgpu/nccl.env",
        "/etc/budgetgpu/jobs/main.env",
    ]
    for template in (REPO / "roles/torchrun/templates").glob("*.j2"):
        assert ROOT_LINE.findall(template.read_text()) == [], template.name
    tasks = yaml.safe_load((REPO / "roles/torchrun/tasks/images.yml").read_text())
    assert [task["name"] for task in tasks if "environment" in task] == []
    text = (REPO / "roles/torchrun/tasks/images.yml").read_text()
    # The only environment images.yml reads is the image's Config.Env (written into the env file, never run),
    # no job's: neither the plan's env nor its environment key.
    assert re.findall(r"\.env\b(?!_file)", text) == [".env"]
    assert "budgetgpu_job_images[item.digest].env" in text


def test_the_unit_files_root_reads_are_rendered_from_no_job_environment():
    for name in ("budgetgpu-job-start@.service.j2", "budgetgpu-job-finish@.service.j2"):
        text = (REPO / "roles/torchrun/templates" / name).read_text()
        assert "EnvironmentFile" not in text and "Environment=" not in text, name
        assert "job.env" not in text and "_torchrun_job" not in text, name
    assert "Environment" not in (REPO / "roles/torchrun/templates/job-record-hardening.j2").read_text()
