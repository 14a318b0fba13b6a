"""A job's container image (issue 44): the key's forms and refusals, what the nodes do with it, the
environment the image gives its unit, and the refusals before an image job starts."""

from __future__ import annotations

import json

import pytest
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.jobs import (
    image_bads,
    image_cuda,
    image_environment,
    image_tarball_problems,
    images_found,
    job_image,
    torchrun_image_differences,
    torchrun_image_problems,
    torchrun_jobs_normalize,
    torchrun_plan,
)

HEX = "ab" * 32
PINNED = f"nvcr.io/nvidia/pytorch:24.01-py3@sha256:{HEX}"
JOB = {"name": "main", "script": "/workspace/train.py", "nodes": "gpu_nodes", "image": PINNED}
GROUPS = {"gpu_nodes": ["node0", "node1"]}


def test_a_pinned_image_runs_from_roots_unpacked_root_filesystem():
    assert job_image(JOB) == {
        # Without the tag: root's commands name the image by its digest alone (test_torchrun_image_trust.py).
        "ref": f"nvcr.io/nvidia/pytorch@sha256:{HEX}",
        "digest": f"sha256:{HEX}",
        "tarball": None,
        "root": f"/var/lib/budgetgpu/images/{HEX}/rootfs",
        "env_file": f"/var/lib/budgetgpu/images/{HEX}/env",
        "nvidia_libraries": "/usr/local/nvidia/lib64",
    }


def test_a_tarball_image_is_named_by_the_id_docker_load_gives():
    image = job_image({**JOB, "image": {"tarball": "/srv/images/train.tar", "digest": f"sha256:{HEX}"}})
    assert (image["ref"], image["tarball"], image["root"]) == (
        f"sha256:{HEX}",
        "/srv/images/train.tar",
        f"/var/lib/budgetgpu/images/{HEX}/rootfs",
    )


def test_a_venv_job_has_no_image():
    assert job_image({"name": "main", "script": "/srv/train.py"}) is None
    assert not list(image_bads({"name": "main"}))


@pytest.mark.parametrize(
    ("image", "field", "expected"),
    [
        ("nvcr.io/nvidia/pytorch:24.01-py3", "image", "NAME@sha256:<64 hex digits>, the image pinned by digest"),
        (f"nvidia/cuda@sha256:{HEX[:10]}", "image", "a digest after the @: sha256: and 64 lowercase hex digits"),
        (f"@sha256:{HEX}", "image", "NAME@sha256:<64 hex digits> with an image name before the @"),
        (
            ["nvidia/cuda"],
            "image",
            "NAME@sha256:<digest>, or {tarball: <path on the control node>, digest: sha256:<id>}",
        ),
        ({"tarball": "train.tar", "digest": f"sha256:{HEX}"}, "image.tarball", "an absolute path on the control node"),
        ({"tarball": "/srv/t.tar"}, "image.digest", "the image id docker load gives: sha256: and 64 lowercase hex"),
        ({"tarball": "/srv/t.tar", "digest": f"sha256:{HEX}", "tag": "x"}, "image.tag", "only tarball and digest"),
    ],
)
def test_a_bad_image_is_refused_naming_job_key_found_and_expected(image, field, expected):
    (bad,) = list(image_bads({**JOB, "image": image}))
    assert bad[0] == field and bad[1] == (image.get(field.partition(".")[2]) if isinstance(image, dict) else image)
    assert bad[2].startswith(expected)
    with pytest.raises(ValueError, match=rf"^job main: {field}: found .*, expected {expected[:20]}"):
        job_image({**JOB, "image": image})


def test_a_tag_alone_is_refused_with_the_way_to_its_digest():
    (bad,) = list(image_bads({**JOB, "image": "nvidia/cuda:12.1.1-runtime-ubuntu22.04"}))
    assert "RepoDigests" in bad[3]


def test_the_plan_carries_the_image_and_refuses_a_bad_one():
    nodes = {"node0": {"gpu_count": 2, "address": "10.0.0.1"}, "node1": {"gpu_count": 2}}
    (item,) = torchrun_plan(
        torchrun_jobs_normalize([JOB]), "node1", GROUPS, nodes, "/opt/budgetgpu/bin/budgetgpu-torchrun"
    )
    assert item["image"]["root"] == f"/var/lib/budgetgpu/images/{HEX}/rootfs"
    # The launcher alone: its #!/usr/bin/env python3 finds the image's python3 on the image's PATH.
    assert item["argv"][:2] == ["/opt/budgetgpu/bin/budgetgpu-torchrun", "--wait-for-master=10.0.0.1:29500"]
    with pytest.raises(ValueError, match="job main: an image job runs through the launcher"):
        torchrun_plan(torchrun_jobs_normalize([JOB]), "node1", GROUPS, nodes)
    (venv_item,) = torchrun_plan(torchrun_jobs_normalize([{**JOB, "image": None}]), "node1", GROUPS, nodes, "/l")
    assert venv_item["image"] is None and venv_item["argv"][:2] == ["/opt/budgetgpu/venv/bin/python3", "/l"]
    with pytest.raises(ValueError, match="job main: image: found 'nvidia/cuda:12.1'"):
        torchrun_plan(torchrun_jobs_normalize([{**JOB, "image": "nvidia/cuda:12.1"}]), "node1", GROUPS, nodes, "/l")


def test_the_images_environment_gets_the_node_package_and_the_drivers_libraries():
    config = ["PATH=/usr/local/bin:/usr/bin", "CUDA_VERSION=12.1.1", "PYTHONPATH=/workspace", "BAD NAME=x"]
    env = image_environment(config, "/opt/budgetgpu/node/packages")
    assert env == {
        "PATH": "/usr/local/bin:/usr/bin",
        "CUDA_VERSION": "12.1.1",
        "PYTHONPATH": "/workspace:/opt/budgetgpu/node/packages",
        "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64",
    }
    cuda_image = ["LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64"]
    assert image_environment(cuda_image, "/p")["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib:/usr/local/nvidia/lib64"
    assert image_cuda(config) == "12.1.1" and image_cuda(["PATH=/bin"]) is None


def facts(image_id: str | None = "sha256:" + "cd" * 32, cuda: str | None = "12.1.1", driver: str = "12.4") -> dict:
    """A node's facts after images.yml: its images (none without image_id) and its driver."""
    images = {f"sha256:{HEX}": {"id": image_id, "cuda": cuda}} if image_id else {}
    gpus = {"count": 1, "driver": {"loaded": True, "cuda_driver_version": driver}}
    return {"budgetgpu_job_images": images, "budgetgpu_gpus": gpus}


def test_the_same_image_on_every_node_within_the_drivers_cuda_passes():
    assert torchrun_image_problems(torchrun_jobs_normalize([JOB]), GROUPS, {"node0": facts(), "node1": facts()}) == []


def test_an_image_missing_on_a_node_is_refused_naming_node_and_image():
    problems = torchrun_image_problems(torchrun_jobs_normalize([JOB]), GROUPS, {"node0": facts(), "node1": facts(None)})
    assert problems == [f"node1: job main: image {PINNED} is missing on the node (the pull did not give it)"]
    tarball = {**JOB, "image": {"tarball": "/srv/t.tar", "digest": f"sha256:{HEX}"}}
    hostvars = {"node0": facts(), "node1": facts(None)}
    (problem,) = torchrun_image_problems(torchrun_jobs_normalize([tarball]), GROUPS, hostvars)
    why = f"docker load gave no image of id sha256:{HEX}"
    assert problem == f"node1: job main: image /srv/t.tar is missing on the node ({why})"


def test_a_node_this_run_did_not_look_at_is_not_judged():
    # An ansible-pull run knows only its own node; a node outside the play has no budgetgpu_job_images.
    hostvars = {"node0": facts(), "node1": {"budgetgpu_gpus": facts()["budgetgpu_gpus"]}}
    assert torchrun_image_problems(torchrun_jobs_normalize([JOB]), GROUPS, hostvars) == []


def test_an_image_that_differs_between_nodes_is_refused_naming_both():
    other = "sha256:" + "ef" * 32
    (problem,) = torchrun_image_problems(
        torchrun_jobs_normalize([JOB]), GROUPS, {"node0": facts(), "node1": facts(other)}
    )
    assert problem == (
        f"job main: image {PINNED} differs between nodes (node0: sha256:{'cd' * 32}, node1: {other}): "
        "every node must run the same image"
    )


def job_lists(**lists):
    """hostvars of nodes whose own job lists (the fact budgetgpu_jobs, every default applied) are the given jobs."""
    return {host: {"budgetgpu_jobs": torchrun_jobs_normalize(jobs)} for host, jobs in lists.items()}


def test_nodes_that_name_different_images_for_a_job_are_refused_before_any_load():
    # The demo cluster: node1's job named the wheelhouse image's tarball, node2's vars another tarball and digest.
    # After the load, torchrun_image_problems called node1's image missing on node2, which held it.
    mine = {"tarball": "/srv/a.tar", "digest": f"sha256:{HEX}"}
    other = {"tarball": "/srv/b.tar", "digest": "sha256:" + "ef" * 32}
    jobs = torchrun_jobs_normalize([{**JOB, "image": mine}])
    hostvars = job_lists(node0=[{**JOB, "image": mine}], node1=[{**JOB, "image": other}])
    assert torchrun_image_differences(jobs, GROUPS, hostvars) == [
        f"job main: its nodes name different images (node0: sha256:{HEX} (/srv/a.tar), node1: sha256:{'ef' * 32} "
        "(/srv/b.tar)): every node must run the same image (a host's or a group's vars name another for some)"
    ]
    # The same digest from another path is the same image.
    hostvars.update(job_lists(node1=[{**JOB, "image": {**mine, "tarball": "/mnt/a.tar"}}]))
    assert torchrun_image_differences(jobs, GROUPS, hostvars) == []
    # A node this run did not look at (no job list), or whose list lacks the job or has it absent, is not judged;
    # absent jobs name no image.
    assert torchrun_image_differences(jobs, GROUPS, {"node0": hostvars["node0"]}) == []
    assert torchrun_image_differences(jobs, GROUPS, {**hostvars, **job_lists(node1=[])}) == []
    gone = [{**JOB, "image": other, "state": "absent"}]
    assert torchrun_image_differences(jobs, GROUPS, {**hostvars, **job_lists(node1=gone)}) == []
    assert torchrun_image_differences(torchrun_jobs_normalize(gone), GROUPS, job_lists(node0=[JOB], node1=[])) == []
    # A bad image key on a node is preflight's to refuse, naming the key: not judged here.
    tag = [{**JOB, "image": "nvidia/cuda:12.1.1-runtime-ubuntu22.04"}]
    assert torchrun_image_differences(jobs, GROUPS, {**hostvars, **job_lists(node1=tag)}) == []


def test_slurm_nodes_whose_slurm_jobs_name_different_images_are_refused_before_any_load():
    # Role slurm brings every batch job's image onto every Slurm node from the node's own slurm_jobs (the inventory's
    # entries, read as given): node1's host vars name another tarball for the job, node2's none.
    mine = {"tarball": "/srv/a.tar", "digest": f"sha256:{HEX}"}
    other = {"tarball": "/srv/b.tar", "digest": "sha256:" + "ef" * 32}
    batch = {"name": "pretrain", "script": "train.py", "gpus_per_node": 2}
    jobs = [{**batch, "image": mine, "nodes": "budgetgpu_slurm_image_nodes"}]
    groups = {"budgetgpu_slurm_image_nodes": ["node0", "node1", "node2"]}
    hostvars = {
        "node0": {"slurm_jobs": [{**batch, "image": mine}]},
        "node1": {"slurm_jobs": [{**batch, "image": other}]},
        "node2": {"slurm_jobs": [batch]},
    }
    assert torchrun_image_differences(jobs, groups, hostvars, "slurm_jobs") == [
        f"job pretrain: its nodes name different images (node0: sha256:{HEX} (/srv/a.tar), node1: sha256:"
        f"{'ef' * 32} (/srv/b.tar), node2: no image: the venv): every node must run the same image (a host's or a "
        "group's vars name another for some)"
    ]
    # The systemd jobs' lists (budgetgpu_jobs) are not the batch jobs'.
    assert torchrun_image_differences(jobs, groups, hostvars) == []
    same = {host: {"slurm_jobs": [{**batch, "image": mine}]} for host in hostvars}
    assert torchrun_image_differences(jobs, groups, same, "slurm_jobs") == []


def test_a_node_whose_own_job_list_runs_the_job_in_the_venv_is_refused_on_every_node_of_the_job():
    # node1's vars give it the job without image: it has no image job, so it never reads the images; its ranks
    # would run in the venv beside node0's in the image. Each node's check reads every node's list: node0 with
    # its image job refuses, and node1 with its venv job refuses too, each naming both nodes.
    hostvars = job_lists(node0=[JOB], node1=[{**JOB, "image": None}])
    expected = [
        f"job main: its nodes name different images (node0: sha256:{HEX} (nvcr.io/nvidia/pytorch@sha256:{HEX}), "
        "node1: no image: the venv): every node must run the same image (a host's or a group's vars name another "
        "for some)"
    ]
    for host in GROUPS["gpu_nodes"]:
        assert torchrun_image_differences(hostvars[host]["budgetgpu_jobs"], GROUPS, hostvars) == expected
    # A venv job on every node names no image: nothing to refuse.
    venv = job_lists(node0=[{**JOB, "image": None}], node1=[{**JOB, "image": None}])
    assert torchrun_image_differences(venv["node0"]["budgetgpu_jobs"], GROUPS, venv) == []


def test_an_image_of_a_newer_cuda_than_a_nodes_driver_is_refused_with_both_versions():
    hostvars = {"node0": facts(cuda="12.4.0", driver="12.4"), "node1": facts(cuda="12.4.0", driver="12.2")}
    (problem,) = torchrun_image_problems(torchrun_jobs_normalize([JOB]), GROUPS, hostvars)
    assert problem == (
        f"node1: job main: image {PINNED} is built for CUDA 12.4.0, the node's driver runs CUDA 12.2: "
        "choose an image of CUDA 12.2 or older, or upgrade the driver"
    )


def test_simulated_nodes_and_images_without_cuda_are_not_compared():
    simulated = {**facts(cuda="13.0"), "budgetgpu_simulated": True}
    hostvars = {"node0": simulated, "node1": facts(cuda=None, driver="11.8")}
    assert torchrun_image_problems(torchrun_jobs_normalize([JOB]), GROUPS, hostvars) == []


def test_venv_jobs_and_absent_jobs_need_no_image():
    jobs = torchrun_jobs_normalize([{**JOB, "image": None}, {**JOB, "name": "gone", "state": "absent"}])
    assert torchrun_image_problems(jobs, GROUPS, {}) == []


def test_the_nodes_images_are_what_docker_inspect_found():
    inspect = [{"Id": "sha256:" + "cd" * 32, "Config": {"Env": ["PATH=/usr/bin", "CUDA_VERSION=12.1.1"]}}]
    image = job_image(JOB)
    results = [
        {"item": image, "rc": 0, "stdout": json.dumps(inspect)},
        {"item": {**image, "digest": "sha256:" + "00" * 32}, "rc": 1, "stdout": "[]"},
    ]
    assert images_found(results) == {
        f"sha256:{HEX}": {
            "id": "sha256:" + "cd" * 32,
            "cuda": "12.1.1",
            "env": ["PATH=/usr/bin", "CUDA_VERSION=12.1.1"],
        }
    }


def tarball_read(manifest: object, digest: str = f"sha256:{HEX}", rc: int = 0, stderr: str = "") -> dict:
    """A result of the tar that reads a tarball's manifest.json on the control node, looped over a node's first
    inspects of its missing images (item: the inspect's result; its item: the image)."""
    image = {"tarball": "/srv/images/train.tar.gz", "digest": digest}
    stdout = manifest if isinstance(manifest, str) else json.dumps(manifest)
    return {"rc": rc, "stdout": stdout, "stderr": stderr, "item": {"rc": 1, "item": image}}


def test_a_tarball_is_its_jobs_image_when_its_manifest_names_that_id_as_docker_save_writes_it():
    # docker save before Docker 25 (Debian's docker.io) and from Docker 25 (its OCI layout's blobs).
    old = [{"Config": f"{HEX}.json", "RepoTags": ["train:v1"], "Layers": ["0d15/layer.tar"]}]
    new = [{"Config": f"blobs/sha256/{HEX}", "RepoTags": ["train:v1"], "Layers": ["blobs/sha256/0d15"]}]
    two = [{"Config": f"{'cd' * 32}.json"}, *old]
    assert image_tarball_problems([tarball_read(old), tarball_read(new), tarball_read(two)], "node1") == []


def test_a_tarball_of_another_image_or_of_no_image_is_refused_naming_node_tarball_and_ids():
    other = [{"Config": f"{'cd' * 32}.json", "RepoTags": ["other:test"]}]
    read_error = "tar: manifest.json: Not found in archive\ntar: Exiting with failure status due to previous errors"
    assert image_tarball_problems(
        [tarball_read(other), tarball_read("", rc=2, stderr=read_error), tarball_read("not json"),
         tarball_read({"Config": "x"})],
        "node1",
    ) == [
        f"node1: image tarball /srv/images/train.tar.gz holds image sha256:{'cd' * 32}, not the job's sha256:{HEX}: "
        "docker load would give no image of that id (scripts/build-job-image prints a tarball and its id)",
        "node1: image tarball /srv/images/train.tar.gz: no manifest.json of docker save in it (tar: Exiting with "
        "failure status due to previous errors): expected `docker save`'s tarball",
        "node1: image tarball /srv/images/train.tar.gz: no manifest.json of docker save in it (unreadable): expected "
        "`docker save`'s tarball",
        "node1: image tarball /srv/images/train.tar.gz: no manifest.json of docker save in it (unreadable): expected "
        "`docker save`'s tarball",
    ]  # fmt: skip
