"""role slurm's batch jobs as the nodes get them: the batch script of a slurm_jobs entry (rendered by Ansible from
the role's templates, with its environment file, one run for every test here) hands torchrun.sbatch the job's
settings; an entry with an image (issue 44) is pinned by digest (a tag alone refused before anything changes),
named by its digest in everything root and the batch script do, and run by torchrun.sbatch with bubblewrap as
the job's user, with the step's GPUs only, the image's environment under the job's own and NCCL's. torchrun.sbatch
runs in bash with srun, scontrol and mountpoint stood in for (its dry run prints each node's command)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.slurm_batch import batch_jobs
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import (
    REPO,
    host_results,
    output_of,
    run_batch,
    run_playbook,
    texts_of,
)
from ansible_collections.budgetgpu.cluster.tests.unit.node_package import NODE_PACKAGES

HEX = "4f" * 32
TAGGED = f"registry.lan:5000/team/train:v1@sha256:{HEX}"
NODES = [
    {"host": name, "name": name, "gpus": [{"index": i, "type": "rtx3090"} for i in range(4)]}
    for name in ("node1", "node2")
]
JOB = {
    "name": "pretrain",
    "script": "train.py",
    "args": ["--lr", "1e-3"],
    "gpus_per_node": 2,
    "image": TAGGED,
    "environment": {"SEED": "7"},
    "group": "ml-team",
}


def plan(job: dict) -> dict:
    return batch_jobs([job], NODES, {"node1": {}, "node2": {}}, "head")[0]


def test_an_image_named_by_a_tag_alone_is_refused_and_a_pinned_one_is_planned_by_its_digest():
    with pytest.raises(ValueError) as raised:
        plan({**JOB, "image": "nvidia/cuda:12.1.1-runtime-ubuntu22.04"})
    assert (
        "head: slurm_jobs[pretrain].image: found 'nvidia/cuda:12.1.1-runtime-ubuntu22.04', expected "
        "NAME@sha256:<64 hex digits>, the image pinned by digest (a tag moves" in str(raised.value)
    )
    image = plan(JOB)["image_plan"]
    assert image["ref"] == f"registry.lan:5000/team/train@sha256:{HEX}"
    assert image["root"] == f"/var/lib/budgetgpu/images/{HEX}/rootfs"
    # torchrun's image tasks read the image as the inventory gives it, as for a systemd job.
    assert plan(JOB)["image"] == TAGGED
    assert plan({**JOB, "image": None})["image_plan"] is None


# A venv job whose arguments and environment hold what a shell would take as code.
VENV_JOB = {"name": "q", "script": "/srv/my train.py", "args": ["--lr", "1e-3; rm -rf /"], "nodes": 2,
            "environment": {"NOTE": "it's $HOME"}, "group": "ml-team"}  # fmt: skip

RENDER = """\
- name: Render the batch jobs' scripts and environments, and the image's mount unit, as role slurm does
  hosts: all
  gather_facts: false
  vars:
    role_path: "{{ test_repo }}/roles/slurm"
    _slurm_home: /opt/s
    _slurm_jobs_dir: "{{ test_out }}"
    _slurm_images_dir: "{{ test_out }}/images"
    _slurm_image_workdir: /budgetgpu/work
  tasks:
    - name: Render each job's script
      ansible.builtin.template:
        src: "{{ test_repo }}/roles/slurm/templates/slurm-job.sbatch.j2"
        dest: "{{ test_out }}/{{ job.name }}.sbatch"
        mode: "0644"
      loop: "{{ test_jobs }}"
      loop_control:
        loop_var: job
    - name: Render each job's environment, where its script looks
      ansible.builtin.template:
        src: "{{ test_repo }}/roles/slurm/templates/slurm-job-environment.j2"
        dest: "{{ test_out }}/{{ job.name }}.env"
        mode: "0644"
      loop: "{{ test_jobs }}"
      loop_control:
        loop_var: job
    - name: Render the image's mount unit
      ansible.builtin.template:
        src: "{{ test_repo }}/roles/slurm/templates/slurm-image.mount.j2"
        dest: "{{ test_out }}/image.mount"
        mode: "0644"
      vars:
        image: "{{ test_jobs[0].image_plan }}"
"""


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    """The directory of the rendered batch scripts (<job>.sbatch), their environments (<job>.env) and the image's
    mount unit (image.mount), for JOB and VENV_JOB as batch_jobs plans them (role slurm's plan)."""
    out = tmp_path_factory.mktemp("rendered")
    variables = {"test_repo": str(REPO), "test_out": str(out), "test_jobs": [plan(JOB), plan(VENV_JOB)]}
    result = run_playbook(out, RENDER, variables)
    assert result.returncode == 0, output_of(result)
    return out


def test_the_batch_script_carries_torchrun_sbatchs_options_and_hands_it_the_environment(tmp_path, rendered):
    text = (rendered / "q.sbatch").read_text()
    # The entry's environment is in the file only its group reads, not in the script every user reads.
    assert "it's" not in text and "NOTE" not in text
    assert "NOTE='it'\"'\"'s $HOME'" in (rendered / "q.env").read_text()
    # torchrun.sbatch's own lines, then the job's; sbatch reads them up to the first command.
    assert [line for line in text.splitlines() if line.startswith("#SBATCH")] == [
        "#SBATCH --ntasks-per-node=1", "#SBATCH --requeue", "#SBATCH --open-mode=append",
        "#SBATCH --job-name=q", "#SBATCH --nodes=2", "#SBATCH --gres=gpu:1",
    ]  # fmt: skip
    assert text.index("#SBATCH --gres") < text.index("set -euo pipefail")
    # bash runs it up to the exec: torchrun.sbatch stands in as a script that prints what it was given.
    fake = tmp_path / "torchrun.sbatch"
    fake.write_text('#!/bin/bash\nprintf "%s\\n" "$@" "$BUDGETGPU_ACCUMULATE_STEPS" "$NOTE"\n')
    fake.chmod(0o755)
    script = tmp_path / "q.sbatch"
    script.write_text(text.replace("exec /opt/s/torchrun.sbatch", f"exec {fake}"))
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["/srv/my train.py", "--lr", "1e-3; rm -rf /", "1", "it's $HOME"]


def test_the_batch_script_and_the_mount_name_the_image_by_its_digest_and_never_its_tag(rendered):
    script = (rendered / "pretrain.sbatch").read_text()
    assert f"export BUDGETGPU_IMAGE=registry.lan:5000/team/train@sha256:{HEX}\n" in script
    assert f"export BUDGETGPU_IMAGE_ROOT={rendered}/images/{HEX}\n" in script
    mount = (rendered / "image.mount").read_text()
    assert f"What=/var/lib/budgetgpu/images/{HEX}/rootfs\n" in mount
    assert f"Where={rendered}/images/{HEX}\n" in mount
    # Read-only for everyone, and nothing of the image's runs with its owner's rights or opens a device.
    assert "Options=bind,ro,nosuid,nodev\n" in mount
    assert ":v1" not in script + mount
    # The mount unit runs nothing and reads no environment: systemd mounts root's tree.
    assert not [line for line in mount.splitlines() if line.startswith(("Exec", "Environment"))]


def test_roots_image_tasks_read_no_jobs_environment():
    tasks = yaml.safe_load((REPO / "roles/slurm/tasks/images.yml").read_text())
    assert [task["name"] for task in tasks if "environment" in task] == []
    text = (REPO / "roles/slurm/tasks/images.yml").read_text()
    # The only environment root writes is the image's Config.Env, as data; never the job's settings or entry's.
    assert "user_env" not in text and "job.env" not in text and "budgetgpu_job_images[item.digest].env" in text


def fake_node(tmp_path: Path, rendered: Path) -> tuple[Path, dict[str, str]]:
    """torchrun.sbatch with its /etc files under tmp_path, the rendered batch script running it, and an
    environment as slurmd gives a step on node1 with GPUs 2 and 3 (Slurm names them by device minor)."""
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "slurm-hosts").write_text("node1 10.0.0.1\n")
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    # The node venv's python (isolated, -I, as the script runs it): here this one, with the node package.
    node_python = tmp_path / "node-python"
    node_python.write_text(
        f'#!/bin/bash\n[ "$1" = -I ] && shift\nPYTHONPATH={NODE_PACKAGES} exec {sys.executable} "$@"\n'
    )
    node_python.chmod(0o755)
    (etc / "slurm-job.env").write_text(
        f"BUDGETGPU_RDZV_PORTS=29600-29999\nBUDGETGPU_CHECKPOINT_ROOT={checkpoints}\n"
        f"BUDGETGPU_NODE_PACKAGES=/opt/budgetgpu/node/packages\nBUDGETGPU_NODE_PYTHON={node_python}\n"
    )
    (etc / "nccl.env").write_text("# the node's\nNCCL_SOCKET_IFNAME=eth1\n")
    images = rendered / "images"
    (images / HEX).mkdir(parents=True, exist_ok=True)
    # The image's environment as the role writes it (one KEY=value a line): NCCL's and the job's own win.
    (images / f"{HEX}.env").write_text(
        "PATH=/opt/conda/bin:/usr/bin\nNCCL_SOCKET_IFNAME=lo\nSEED=image\nLD_LIBRARY_PATH=/usr/local/nvidia/lib64\n"
    )
    (images / "driver-libraries").write_text("/usr/lib/libcuda.so.535.1\n/usr/lib/libcuda.so.1\n")
    sbatch = (REPO / "roles/slurm/files/torchrun.sbatch").read_text().replace("/etc/budgetgpu", str(etc))
    (tmp_path / "torchrun.sbatch").write_text(sbatch)
    batch = (rendered / "pretrain.sbatch").read_text()
    script = batch.replace("/opt/s/torchrun.sbatch", f"bash {tmp_path}/torchrun.sbatch")
    (tmp_path / "pretrain.sbatch").write_text(script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {
        "scontrol": "echo node1",
        "srun": 'while [ "${1#--}" != "$1" ]; do shift; done; exec "$@"',
        "mountpoint": "exit 0",
    }.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_JOB_ID": "42",
        "SLURM_NNODES": "1",
        "SLURMD_NODENAME": "node1",
        "SLURM_GPUS_ON_NODE": "2",
        "SLURM_STEP_GPUS": "2,3",
        "BUDGETGPU_DRY_RUN": "1",
    }
    return tmp_path / "pretrain.sbatch", env


def pairs(words: list[str], option: str) -> list[tuple[str, str]]:
    return [(words[i + 1], words[i + 2]) for i, word in enumerate(words) if word == option]


def test_torchrun_sbatch_runs_the_image_with_bwrap_as_the_user_with_the_steps_gpus_alone(tmp_path, rendered):
    script, env = fake_node(tmp_path, rendered)
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, check=False, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    node, line = done.stdout.strip().split(": ", 1)
    words = line.split()
    # bwrap itself, as whoever runs the step (no sudo, no setuid helper), the image read-only as its root.
    assert node == "node1" and words[:2] == ["bwrap", "--die-with-parent"]
    assert ("--ro-bind", str(rendered / "images" / HEX), "/") == tuple(words[2:5])
    # Only the step's GPUs, by device minor; the driver's control devices where the node has them.
    assert pairs(words, "--dev-bind") == [("/dev/nvidia2", "/dev/nvidia2"), ("/dev/nvidia3", "/dev/nvidia3")]
    controls = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    assert pairs(words, "--dev-bind-try") == [(device, device) for device in controls]
    # The user's directories: the job's checkpoint directory at its own path, the submit directory at the workdir.
    user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
    checkpoint = f"{tmp_path}/checkpoints/{user}/42"
    assert pairs(words, "--bind") == [(checkpoint, checkpoint), (str(tmp_path), "/budgetgpu/work")]
    assert ("/usr/lib/libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1") in pairs(words, "--ro-bind")
    # The image's environment, but NCCL's (nccl.env) and the job's own (the entry's SEED) stand.
    # And the workers' store of their own (the launcher puts it on the job's store port), whatever the image says.
    assert pairs(words, "--setenv") == [
        ("PATH", "/opt/conda/bin:/usr/bin"), ("LD_LIBRARY_PATH", "/usr/local/nvidia/lib64"),
        ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"),
    ]  # fmt: skip
    # The systemd jobs' launcher, bound read-only, run by the image's python: the store on the job's second port.
    assert ("/opt/budgetgpu/slurm/budgetgpu-torchrun", "/tmp/budgetgpu-torchrun") in pairs(words, "--ro-bind")
    assert words[words.index("--") :][:4] == ["--", "python3", "/tmp/budgetgpu-torchrun", "--store-port=29685"]
    assert "--nproc-per-node=2" in words and words[-3:] == ["train.py", "--lr", "1e-3"]


def test_torchrun_sbatch_refuses_an_image_missing_on_the_node_and_checkpoints_outside_the_root(tmp_path, rendered):
    script, env = fake_node(tmp_path, rendered)
    done = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, check=False, cwd=tmp_path,
        env={**env, "BUDGETGPU_CHECKPOINT_DIR": str(tmp_path / "elsewhere")},
    )  # fmt: skip
    assert done.returncode == 1 and "an image job keeps its checkpoints in" in done.stderr
    (rendered / "images" / f"{HEX}.env").unlink()
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, check=False, cwd=tmp_path)
    assert done.returncode == 1
    assert f"node1: image registry.lan:5000/team/train@sha256:{HEX} is not on this node" in done.stderr


def make_mount_points(rootfs: Path, packages: Path) -> subprocess.CompletedProcess[str]:
    """The role's task "Make the mount points the batch script binds onto in each image" as root runs it (the
    node venv's python, the node package as budgetgpu_node), on rootfs: it prints the mount points it made."""
    task = next(
        task
        for task in yaml.safe_load((REPO / "roles/slurm/tasks/images.yml").read_text())
        if task["name"] == "Make the mount points the batch script binds onto in each image"
    )
    code = task["ansible.builtin.command"]["argv"][3]
    points = ["/usr/local/nvidia/lib64", "/opt/budgetgpu/node/packages", "/var/lib/ckpt", "/budgetgpu/work"]
    return subprocess.run(
        [sys.executable, "-c", code, str(rootfs), *points],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(packages)},
    )


def test_root_makes_the_mount_points_in_the_image_once_and_follows_no_link_of_the_image(tmp_path):
    packages = tmp_path / "packages"
    packages.mkdir()
    (packages / "budgetgpu_node").symlink_to(REPO / "plugins" / "module_utils")
    rootfs = tmp_path / "rootfs"
    (rootfs / "usr").mkdir(parents=True)
    made = make_mount_points(rootfs, packages)
    assert made.returncode == 0, made.stderr
    assert made.stdout.split() == ["/usr/local/nvidia/lib64", "/opt/budgetgpu/node/packages", "/var/lib/ckpt",
                                   "/budgetgpu/work"]  # fmt: skip
    assert (rootfs / "budgetgpu" / "work").is_dir()
    # Made once: the next run makes nothing (the task reports no change).
    assert make_mount_points(rootfs, packages).stdout == ""
    # An image whose /usr/local is a link out of it: refused, and nothing made where the link points.
    outside = tmp_path / "outside"
    outside.mkdir()
    linked = tmp_path / "linked"
    (linked / "usr").mkdir(parents=True)
    (linked / "usr" / "local").symlink_to(outside)
    refused = make_mount_points(linked, packages)
    assert refused.returncode != 0 and "a link is refused" in refused.stderr
    assert list(outside.iterdir()) == []


USERNS_PLAY = """\
- name: The bubblewrap check of role slurm's image tasks
  hosts: all
  gather_facts: false
  tasks:
    - name: Try bwrap as a job's user would
      ansible.builtin.include_role:
        name: budgetgpu.cluster.slurm
        tasks_from: userns.yml
    - name: A later step that must not run where bwrap failed
      ansible.builtin.copy:
        content: written
        dest: "{{ marker }}"
        mode: "0644"
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the check runs bwrap as nobody with setpriv")
@pytest.mark.parametrize("works", [True, False])
def test_a_node_where_a_user_cannot_run_bwrap_is_refused_with_its_kernel_settings(tmp_path, works):
    """bwrap stood in by a script nobody may run (in a 0755 directory outside pytest's 0700 tmp_path) that says
    who ran it, then fails as bwrap does where user namespaces are refused, or succeeds."""
    fakes = Path(tempfile.mkdtemp(prefix="bwrap-"))
    try:
        fakes.chmod(0o755)
        fake = fakes / "bwrap"
        fake.write_text(
            '#!/bin/sh\necho "bwrap: setting up uid map: Permission denied (uid $(id -u), HOME $HOME, args $*)" >&2\n'
            f"exit {0 if works else 1}\n"
        )
        fake.chmod(0o755)
        marker = tmp_path / "after"
        result = run_playbook(tmp_path, USERNS_PLAY, {"_slurm_bwrap": str(fake), "marker": str(marker)})
    finally:
        shutil.rmtree(fakes)
    out = output_of(result)
    if works:
        assert result.returncode == 0, out
        assert marker.exists()
        return
    assert result.returncode != 0 and not marker.exists(), out
    assert (
        "node7: slurm_jobs has image jobs, which torchrun.sbatch runs with bubblewrap as the job's user, and bwrap "
        "fails here for an unprivileged user (nobody, exit 1: bwrap: setting up uid map: Permission denied (uid "
        "65534, HOME /nonexistent, args --ro-bind / / --dev /dev /bin/true))" in out
    ), out
    assert re.search(r"the kernel has user\.max_user_namespaces=\w+, kernel\.unprivileged_userns_clone=\w+, "
                     r"kernel\.apparmor_restrict_unprivileged_userns=\w+: expected", out), out  # fmt: skip
    assert "No image was brought to the node." in out


def test_torchrun_sbatch_takes_the_jobs_two_ports_from_its_id_and_refuses_another(tmp_path, rendered):
    """The rendezvous port and the workers' store port (the launcher's --store-port) are the pair of the range that
    slurm_energy.job_ports gives the job's id, the two the Prolog opens to the job's user; a port the user names is
    refused (before, BUDGETGPU_RDZV_PORT took any port, and the store was on a free port torch picked)."""
    env = fake_node(tmp_path, rendered)[1]
    script = str(tmp_path / "torchrun.sbatch")
    for job, rendezvous, store in (("42", 29684, 29685), ("241", 29682, 29683)):
        done = subprocess.run(
            ["bash", script, "train.py"], capture_output=True, text=True, env={**env, "SLURM_JOB_ID": job},
            check=False, cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        words = done.stdout.strip().split(": ", 1)[1].split()
        assert words[:3] == [
            "/opt/budgetgpu/venv/bin/python3",
            "/opt/budgetgpu/slurm/budgetgpu-torchrun",
            f"--store-port={store}",
        ]
        assert f"--rdzv-endpoint=10.0.0.1:{rendezvous}" in words
    done = subprocess.run(
        ["bash", script, "train.py"], capture_output=True, text=True, env={**env, "BUDGETGPU_RDZV_PORT": "29700"},
        check=False, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2 and "BUDGETGPU_RDZV_PORT=29700 refused" in done.stderr and not done.stdout


IMAGES_TASKS = REPO / "roles" / "slurm" / "tasks" / "images.yml"
DIFFERENCES = "Require each batch job to name one image on every Slurm node"


def test_a_slurm_node_whose_slurm_jobs_name_no_image_is_judged_before_any_image_comes(tmp_path):
    # The role's own task, as images.yml has it, on the Slurm nodes with images (node0; group_by made their group):
    # node1's host vars give the job no image, and node1 is not in that group, yet it is judged.
    tasks = yaml.safe_load(IMAGES_TASKS.read_text())
    check = next(task for task in tasks if task["name"] == DIFFERENCES)
    play = [{"name": "The batch jobs' image check", "hosts": "all", "gather_facts": False, "tasks": [check]}]
    job = {**JOB, "image": f"registry.lan/team/train@sha256:{HEX}"}
    image_jobs = [{**plan(job), "nodes": "budgetgpu_slurm_image_nodes"}]
    common = {"slurm_node_hosts": ["node0", "node1"], "_slurm_image_jobs": image_jobs}
    report = run_batch(
        tmp_path,
        yaml.safe_dump(play),
        {"node0": {**common, "slurm_jobs": [job]}, "node1": {**common, "slurm_jobs": [{**JOB, "image": None}]}},
        options=("--limit", "node0"),
    )
    [(task, result)] = host_results(report, "node0")
    assert (task, result.get("failed")) == (DIFFERENCES, True)
    assert texts_of(result.get("msg")) == (
        f"slurm_jobs refused: nothing was changed job pretrain: its nodes name different images (node0: sha256:{HEX} "
        f"(registry.lan/team/train@sha256:{HEX}), node1: no image: the venv): every node must run the same image (a "
        "host's or a group's vars name another for some)"
    )
