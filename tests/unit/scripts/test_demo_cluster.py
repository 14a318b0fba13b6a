"""scripts/demo-cluster's DEMO_IMAGE_JOB=1: the demo job runs in the image scripts/build-job-image saves, through
torchrun_job_defaults (docs/job-images.md, "Try it on the demo cluster"); without it the demo is as before."""

from __future__ import annotations

import json
import subprocess

import pytest
from ansible_collections.budgetgpu.cluster.tests.unit.fake_host import REPO
from ansible_collections.budgetgpu.cluster.tests.unit.file_modules import load_file_module

TARBALL = "/var/cache/budgetgpu/job-image/budgetgpu-job-image-0123456789ab.tar.gz"
DIGEST = "sha256:" + "ab" * 32


@pytest.fixture
def demo(monkeypatch):
    module = load_file_module("demo_cluster", REPO / "scripts" / "demo-cluster")
    calls = []

    def run(argv, **_kw):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout=f"{TARBALL} {DIGEST}\n", stderr="")

    monkeypatch.setattr(module, "run", run)
    monkeypatch.delenv("DEMO_IMAGE_JOB", raising=False)
    return module, calls


def test_the_demo_job_stays_a_venv_job_by_default(demo):
    module, calls = demo
    assert module.image_job_vars() == []
    assert calls == []


def test_demo_image_job_gives_every_job_the_built_image(demo, monkeypatch):
    module, calls = demo
    monkeypatch.setenv("DEMO_IMAGE_JOB", "1")
    flag, extra = module.image_job_vars()
    assert calls == [[str(REPO / "scripts" / "build-job-image")]]
    assert flag == "-e"
    assert json.loads(extra) == {"torchrun_job_defaults": {"image": {"tarball": TARBALL, "digest": DIGEST}}}


def test_up_forgets_the_cached_facts_and_passes_the_image_to_every_job_playbook(demo, monkeypatch):
    # `make demo-down && make demo` within the hour of ansible.cfg's fact cache: the probe took the removed nodes'
    # node venv for the new nodes' and failed ("/opt/budgetgpu/node/bin/python3 was not found").
    module, _calls = demo
    playbooks = []
    monkeypatch.setattr(module, "playbook", playbooks.append)
    for name in ("ensure_key", "start_nodes", "authorize_admin", "record_host_keys", "write_inventory", "export_model"):
        monkeypatch.setattr(module, name, lambda *_a: None)
    for name in ("wait_for_progress", "summary", "ask_gateway"):
        monkeypatch.setattr(module, name, lambda *_a: None)
    monkeypatch.setattr(module, "address_of", lambda name: name)
    monkeypatch.setattr(module, "node_exec", lambda *_a: "")
    monkeypatch.setenv("DEMO_IMAGE_JOB", "1")
    module.up()
    assert playbooks[0] == ["playbooks/simulate_gpus.yml", "--flush-cache"]
    image = module.image_job_vars()
    with_image = [args[0] for args in playbooks if args[1:3] == image]
    assert with_image == ["site.yml", "playbooks/train.yml", "playbooks/inference.yml"], playbooks
