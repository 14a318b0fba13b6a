"""A job whose nodes name different images, or one none (issue 44): a host's vars give node1 the job without its
image, so node1 would run its ranks in the venv beside node0's in the image. node1 has no image job: the images'
tasks (tasks/images.yml), where this was judged before, never ran there, and node0 could not see node1's list.
Torchrun's `jobs` entry point (which preflight runs first, and the role when run alone) reads every node's job
list: here as the role runs it, on two fake local nodes, each refuses with the same line and no later task runs.
"""

from __future__ import annotations

from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import host_results, run_batch, texts_of

PLAYBOOK = """\
- name: Torchrun's jobs on two nodes whose own job lists differ
  hosts: all
  gather_facts: false
  tasks:
    - name: Work out the jobs as preflight does (role run_inputs)
      ansible.builtin.include_role:
        name: budgetgpu.cluster.torchrun
        tasks_from: jobs
    - name: After the jobs' checks
      ansible.builtin.debug:
        msg: reached
"""
HEX = "ab" * 32
JOB = {"name": "main", "script": "/srv/train.py", "nodes": "all", "image": f"registry.lan/team/train@sha256:{HEX}"}
CHECK = "Require each job to name one image, or none, on all of its nodes"


def test_a_node_whose_vars_give_the_job_no_image_is_refused_on_every_node_before_anything(tmp_path):
    report = run_batch(
        tmp_path, PLAYBOOK, {"node0": {"torchrun_jobs": [JOB]}, "node1": {"torchrun_jobs": [{**JOB, "image": None}]}}
    )
    for host in ("node0", "node1"):
        results = [
            (task.removeprefix("budgetgpu.cluster.torchrun : "), result) for task, result in host_results(report, host)
        ]
        task, result = results[-1]
        assert (task, result.get("failed")) == (CHECK, True), results
        assert texts_of(result.get("msg")) == (
            "jobs refused: nothing was changed job main: its nodes name different images (node0: "
            f"sha256:{HEX} (registry.lan/team/train@sha256:{HEX}), node1: no image: the venv): every node must run "
            "the same image (a host's or a group's vars name another for some)"
        )
