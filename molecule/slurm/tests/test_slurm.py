"""Slurm on a container cluster: each node's GPUs in sinfo with the probe's types and counts (less the
GPU an inference worker holds), srun jobs that get exactly the GPUs they ask for and can open only
those device nodes, one munge key everywhere, and Slurm's ports closed to a host outside the cluster."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import time
from pathlib import Path

import pytest
import testinfra

CONTROLLER = "slurm-controller"
NODES = ("slurm-node1", "slurm-node2")
NETWORK = "budgetgpu-molecule-slurm"
PROFILES = Path(__file__).resolve().parents[3] / "roles" / "gpu_sim" / "files" / "profiles"
# The example job and its helper, as a user would bring their own training script.
EXAMPLE = Path(__file__).resolve().parents[3] / "roles" / "torchrun" / "files"
STATE = Path(os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY", "/nonexistent")) / "state"
# The GRES types the issue names for these PCI device ids; node2's GPU 2 (an RTX 4090) serves the
# inventory's inference service, so Slurm must not have it.
TYPES = {"0x2204": "rtx3090", "0x2684": "rtx4090"}
PROFILE = {"slurm-node1": "rtx3090x4-risers", "slurm-node2": "mixed-3090-4090"}
HELD = {"slurm-node1": set(), "slurm-node2": {2}}


def host(name: str) -> testinfra.host.Host:
    return testinfra.get_host(f"docker://{name}")


def expected_gres(name: str) -> dict[str, int]:
    """Return {type: count} from the node's simulated profile (NVML index order), less the held GPUs."""
    profile = json.loads((PROFILES / f"{PROFILE[name]}.json").read_text())
    gpus = [f["device"] for f in profile["pci"] if "nvml" in f]
    counts: dict[str, int] = {}
    for index, device in enumerate(gpus):
        if index not in HELD[name]:
            counts[TYPES[device]] = counts.get(TYPES[device], 0) + 1
    return counts


def sinfo() -> dict[str, tuple[str, str]]:
    out = host(CONTROLLER).check_output("sinfo --noheader --Node --format='%N|%G|%T'")
    return {n: (g, t) for n, g, t in (line.split("|") for line in out.splitlines())}


def srun(args: str, command: str, user: str = "nobody") -> subprocess.CompletedProcess[str]:
    """Run srun on the controller (so its I/O ports cross the firewall from the nodes) as a user."""
    return host(CONTROLLER).run(f"runuser -u {user} -- timeout 120 srun {args} bash -c {shlex.quote(command)}")


@pytest.mark.parametrize("name", NODES)
def test_sinfo_shows_the_probes_gpu_types_and_counts(name: str) -> None:
    # On two loaded cores a ping may time out for a moment ("idle*", not responding): wait it out.
    deadline = time.monotonic() + 120
    while (found := sinfo()[name])[1] != "idle" and time.monotonic() < deadline:
        time.sleep(3)
    gres, state = found
    # "gpu:rtx3090:2,gpu:rtx4090:1" (sinfo may add the socket binding: "(S:0)").
    found = {part.split(":")[1]: int(part.split(":")[2].split("(")[0]) for part in gres.split(",")}
    assert found == expected_gres(name)
    assert state == "idle"


def test_the_held_gpu_is_left_out_of_gres_conf() -> None:
    gres = host("slurm-node2").file("/etc/slurm/gres.conf").content_string
    lines = [line for line in gres.splitlines() if line.startswith("NodeName=slurm-node2 ")]
    assert [line.split("File=")[1].split()[0] for line in lines] == ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia3"]
    assert (
        "GPU 2 (0000:41:00.0) left out: inference worker budgetgpu-infer-embed@0.service"
        in host(CONTROLLER).file("/etc/slurm/slurm.conf").content_string
    )


def test_real_memory_lies_below_what_slurmd_detects() -> None:
    detected = int(host("slurm-node1").check_output("slurmd -C").split("RealMemory=")[1].split()[0])
    conf = host(CONTROLLER).check_output("scontrol show node slurm-node1")
    configured = int(conf.split("RealMemory=")[1].split()[0])
    assert detected - 512 >= configured >= detected * 0.9


# Opens each GPU device node from inside a job step. With no driver behind them, a node the device
# cgroup allows answers ENXIO; one it denies, EPERM; one whose mode (0660, the GPU group) refuses the user, EACCES.
# Also what Slurm says it granted: the GPUs' gres.conf indices (File=/dev/nvidiaN in order on these nodes) and
# CUDA_VISIBLE_DEVICES. The jobs run as ana, a member of the GPU group (budgetgpu_gpu_users).
OPEN_GPUS = """
import errno, glob, json, os
answers = {}
for path in sorted(glob.glob("/dev/nvidia[0-9]*")):
    try:
        os.close(os.open(path, os.O_RDONLY))
        answers[path] = "opened"
    except OSError as err:
        answers[path] = errno.errorcode[err.errno]
granted = os.environ.get("SLURM_STEP_GPUS") or os.environ.get("SLURM_JOB_GPUS", "")
print(json.dumps({"open": answers, "granted": granted, "visible": os.environ.get("CUDA_VISIBLE_DEVICES", "")}))
"""


def open_gpus(args: str, command: str = f"python3 -c {shlex.quote(OPEN_GPUS)}", user: str = "ana") -> dict:
    result = srun(args, command, user)
    assert result.rc == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_job_that_asks_for_two_gpus_can_open_exactly_those_two() -> None:
    found = open_gpus("-w slurm-node1 --gres=gpu:2")
    granted = sorted(f"/dev/nvidia{index}" for index in found["granted"].split(","))
    allowed = sorted(path for path, answer in found["open"].items() if answer == "ENXIO")
    assert len(granted) == 2 and allowed == granted, found
    # node1's other two GPUs are there and refused by the job's device cgroup.
    assert sorted(found["open"].values()) == ["ENXIO", "ENXIO", "EPERM", "EPERM"], found
    assert len(found["visible"].split(",")) == 2, found


def test_the_device_cgroup_lets_a_job_open_only_its_gpus() -> None:
    found = open_gpus("-w slurm-node1 --gres=gpu:rtx3090:1")
    assert sorted(found["open"].values()) == ["ENXIO"] + ["EPERM"] * 3, found
    assert [path for path, answer in found["open"].items() if answer == "ENXIO"] == [f"/dev/nvidia{found['granted']}"]


# What torchrun.sbatch gives an image job's torchrun (files/torchrun.sbatch), less the image: the host's /usr as its
# root, every GPU of the node bound in (more than the script binds: what a user trying to escape could bind).
IN_BWRAP = (
    "bwrap --die-with-parent --ro-bind /usr /usr --symlink usr/bin /bin --symlink usr/lib /lib"
    " --symlink usr/lib64 /lib64 --dev /dev --tmpfs /dev/shm --ro-bind /proc /proc --ro-bind /sys /sys --tmpfs /tmp "
    + " ".join(f"--dev-bind /dev/nvidia{index} /dev/nvidia{index}" for index in range(4))
)


def test_an_image_jobs_bubblewrap_runs_as_the_user_in_its_step_and_the_device_cgroup_still_confines_it() -> None:
    """Issue 44: an image job's torchrun runs in bwrap, unprivileged (Debian's bwrap is not setuid), in the job
    step's cgroup. Inside, the user keeps the GPU group (ENXIO on its GPU, not EACCES) and the step's device cgroup
    refuses the node's other GPUs even where the user binds them in (EPERM)."""
    assert host("slurm-node1").file("/usr/bin/bwrap").mode == 0o755
    found = open_gpus("-w slurm-node1 --gres=gpu:rtx3090:1", f"{IN_BWRAP} -- python3 -c {shlex.quote(OPEN_GPUS)}")
    assert sorted(found["open"].values()) == ["ENXIO"] + ["EPERM"] * 3, found
    assert [path for path, answer in found["open"].items() if answer == "ENXIO"] == [f"/dev/nvidia{found['granted']}"]


def test_the_gpu_device_files_are_not_open_to_every_user() -> None:
    """Issue 40 item 3: root's, mode 0660, of the GPU group, whose members are the inventory's Slurm users and the
    training user (root's torch checks run as it); a job of a user outside it opens no GPU, not even the one Slurm
    gave it."""
    for name in NODES:
        modes = host(name).check_output("stat -c '%n %U %G %a' /dev/nvidia[0-9]*").splitlines()
        assert modes == [f"/dev/nvidia{i} root budgetgpu-gpu 660" for i in range(4)], modes
        assert host(name).check_output("getent group budgetgpu-gpu").strip().split(":")[3] == "ana,ben,budgetgpu"
    found = open_gpus("-w slurm-node1 --gres=gpu:rtx3090:1", user="nobody")
    assert found["granted"] and set(found["open"].values()) == {"EACCES"}, found


def test_the_cpuset_cgroup_confines_a_job_to_its_cores() -> None:
    result = srun("-w slurm-node1 --ntasks=1 --cpus-per-task=1", "grep Cpus_allowed_list /proc/self/status")
    assert result.rc == 0, result.stderr
    allowed = result.stdout.split()[-1]
    assert "," not in allowed and "-" not in allowed, f"one CPU expected, found {allowed}"


def test_a_job_cannot_get_the_gpu_an_inference_worker_holds() -> None:
    result = srun("-w slurm-node2 --gres=gpu:rtx4090:2 --immediate=10", "true")
    assert result.rc != 0
    assert "Requested node configuration is not available" in result.stderr


OPEN_ONE = """
import errno, os, sys
try:
    os.close(os.open(sys.argv[1], os.O_RDONLY))
except OSError as err:
    print(errno.errorcode[err.errno])
"""


def open_as(name: str, user: str, path: str) -> str:
    """Open a device node on a node as a user, outside Slurm: "opened", or the error's name (ENXIO: allowed)."""
    command = f"runuser -u {user} -- python3 -c {shlex.quote(OPEN_ONE)} {path}"
    return host(name).check_output(command).strip() or "opened"


def test_a_job_cannot_open_the_gpu_an_inference_worker_holds_and_the_workers_user_can() -> None:
    """Issue 40 item 3: the held GPU is not in gres.conf, so the job's device cgroup does not deny it; its device file
    (still root budgetgpu-gpu 660 to stat, which the driver compares) has a POSIX ACL that gives it to the worker's
    user alone of the GPU group. ana's job opens the GPU Slurm gave it (ENXIO: no driver behind the node), not the
    held one (EACCES), and node2's other GPUs are denied by the device cgroup (EPERM). At boot /dev is new (here:
    the node made again by gpu_sim's unit, as the driver would, without the ACL) and slurmd's start sets it again."""
    found = open_gpus("-w slurm-node2 --gres=gpu:rtx3090:1")
    granted = f"/dev/nvidia{found['granted']}"
    assert found["open"].pop("/dev/nvidia2") == "EACCES", found
    assert found["open"].pop(granted) == "ENXIO" and set(found["open"].values()) == {"EPERM"}, found
    node = host("slurm-node2")
    acl = "user::rw-\nuser:budgetgpu-infer:rw-\ngroup::---\nmask::rw-\nother::---"
    assert node.check_output("getfacl --omit-header /dev/nvidia2") == acl
    assert open_as("slurm-node2", "budgetgpu-infer", "/dev/nvidia2") == "ENXIO"
    assert open_as("slurm-node2", "ana", "/dev/nvidia1") == "ENXIO"
    node.check_output("rm /dev/nvidia2 && systemctl restart budgetgpu-sim-nvidia-devices.service")
    assert open_as("slurm-node2", "ana", "/dev/nvidia2") == "ENXIO"
    node.check_output("systemctl restart slurmd.service")
    assert open_as("slurm-node2", "ana", "/dev/nvidia2") == "EACCES"
    assert node.check_output("getfacl --omit-header /dev/nvidia2") == acl
    assert open_as("slurm-node2", "budgetgpu-infer", "/dev/nvidia2") == "ENXIO"


def test_a_job_spans_both_nodes() -> None:
    result = srun("--nodes=2 --gres=gpu:rtx3090:2", "echo $(hostname) $CUDA_VISIBLE_DEVICES")
    assert result.rc == 0, result.stderr
    lines = sorted(result.stdout.strip().splitlines())
    assert [line.split()[0] for line in lines] == list(NODES)
    assert all(len(line.split()[1].split(",")) == 2 for line in lines)


def test_slurmd_gives_up_on_the_prolog_and_epilog_at_the_roles_timeout() -> None:
    config = host(CONTROLLER).check_output("scontrol show config")
    assert re.search(r"^PrologEpilogTimeout\s*=\s*60\b", config, re.MULTILINE), config


def test_a_jobs_environment_is_in_a_file_only_its_group_may_read() -> None:
    node = host("slurm-node1")
    env = node.file("/opt/budgetgpu/slurm/jobs/resume-demo.env")
    assert (env.user, env.group, env.mode) == ("root", "nogroup", 0o640)
    assert "not-a-real-token" not in node.file("/opt/budgetgpu/slurm/jobs/resume-demo.sbatch").content_string
    assert node.run("runuser -u ana -- cat /opt/budgetgpu/slurm/jobs/resume-demo.env").rc != 0
    assert "not-a-real-token" in node.check_output("runuser -u nobody -- cat /opt/budgetgpu/slurm/jobs/resume-demo.env")


def test_a_differing_munge_key_on_a_node_is_refused_and_nothing_changes(playbook) -> None:
    """A node whose munge key is not the one the role installed (the control node's copy is another admin's, or
    someone changed the node's): the run refuses it, naming the host, the file and slurm_munge_key_rotate, and
    leaves the key as it found it. (munged keeps the key it read at its start: the cluster still works.)"""
    node = host("slurm-node2")
    key = "/etc/munge/munge.key"
    node.check_output(f"cp -p {key} /root/munge.key.kept && head -c 1024 /dev/urandom > {key}")
    try:
        other = node.check_output(f"sha256sum {key}").split()[0]
        done = playbook("slurm.yml", "--tags", "slurm_install", "--limit", "localhost,slurm-node2")
        assert done.returncode != 0
        said = f"slurm-node2: {key} holds another munge key than the control node's"
        assert said in done.stdout and "slurm_munge_key_rotate=true" in done.stdout, done.stdout[-3000:]
        assert node.check_output(f"sha256sum {key}").split()[0] == other
    finally:
        node.check_output(f"cp -p /root/munge.key.kept {key} && rm /root/munge.key.kept")


def test_a_differing_munge_key_without_the_roles_record_is_refused_too(playbook) -> None:
    """The first run after an upgrade: a node provisioned before the role recorded its key's SHA-256 holds a key
    other than the control node's. Not munge's package's own (that package was there before this run): refused,
    naming the host, the file and both digests, with key and record as they were."""
    node = host("slurm-node2")
    key, mark = "/etc/munge/munge.key", "/etc/budgetgpu/slurm-munge-key.sha256"
    node.check_output(
        f"cp -p {key} /root/munge.key.kept && mv {mark} /root/munge.mark.kept && head -c 1024 /dev/urandom > {key}"
    )
    try:
        other = node.check_output(f"sha256sum {key}").split()[0]
        cluster = subprocess.run(
            ["sha256sum", str(STATE / "slurm" / "munge.key")], capture_output=True, text=True, check=True
        ).stdout.split()[0]
        done = playbook("slurm.yml", "--tags", "slurm_install", "--limit", "localhost,slurm-node2")
        assert done.returncode != 0
        said = f"slurm-node2: {key} holds another munge key than the control node's"
        assert said in done.stdout and "slurm_munge_key_rotate=true" in done.stdout, done.stdout[-3000:]
        assert f"SHA-256 {other} on slurm-node2" in done.stdout and f"{cluster} on the control node" in done.stdout
        assert node.check_output(f"sha256sum {key}").split()[0] == other
        assert not node.file(mark).exists
    finally:
        node.check_output(f"mv /root/munge.key.kept {key} && mv /root/munge.mark.kept {mark}")


def test_one_munge_key_everywhere() -> None:
    sums = set()
    for name in (CONTROLLER, *NODES):
        key = host(name).file("/etc/munge/munge.key")
        assert (key.user, key.group, key.mode) == ("munge", "munge", 0o400)
        sums.add(host(name).check_output("sha256sum /etc/munge/munge.key").split()[0])
    assert len(sums) == 1
    assert (STATE / "slurm" / "munge.key").stat().st_mode & 0o777 == 0o600
    # A credential made on the controller is accepted on a node.
    credential = host(CONTROLLER).check_output("munge -n")
    assert host("slurm-node1").run(f"echo {credential} | unmunge").rc == 0


def _address(container: str) -> str:
    out = subprocess.check_output(
        ["docker", "inspect", "-f", f'{{{{(index .NetworkSettings.Networks "{NETWORK}").IPAddress}}}}', container],
        text=True,
    )
    return out.strip()


def listen(name: str, port: int) -> None:
    """A listener of nobody's on the port for 30 s, where nothing of Slurm's listens between jobs (srun's
    range, the batch jobs' rendezvous range): without one, a refused connection proves nothing."""
    server = f"import socket, time; server = socket.create_server(('', {port})); time.sleep(30)"
    node = host(name)
    node.run(f"setsid runuser -u nobody -- timeout 30 python3 -c {shlex.quote(server)} >/dev/null 2>&1 &")
    deadline = time.monotonic() + 10
    while f":{port} " not in node.run("ss -Htln").stdout:
        assert time.monotonic() < deadline, f"{name}: nothing listens on {port}"
        time.sleep(0.2)


# slurmctld, slurmd, slurmdbd, srun's I/O range (on the host that runs srun) and the batch jobs' rendezvous range.
@pytest.mark.parametrize(
    ("name", "port"),
    [(CONTROLLER, 6817), ("slurm-node1", 6818), (CONTROLLER, 6819), (CONTROLLER, 60001), ("slurm-node1", 29650)],
)
def test_slurms_ports_refuse_a_host_outside_the_cluster(name: str, port: int) -> None:
    if port not in (6817, 6818, 6819):
        listen(name, port)
    # This machine is on the scenario's network (its gateway) but is no cluster host: the table resets it.
    with pytest.raises(ConnectionRefusedError), socket.create_connection((_address(name), port), timeout=10):
        pass
    # The cluster's own hosts reach the port.
    reach = host(NODES[1]).run(f"timeout 5 bash -c 'exec 3<>/dev/tcp/{_address(name)}/{port}'")
    assert reach.rc == 0, reach.stderr


def test_the_batch_script_puts_the_rendezvous_on_the_first_nodes_cluster_address() -> None:
    # A dry run prints each node's torchrun command: torch itself is not in this scenario.
    ctl = host(CONTROLLER)
    job = ctl.check_output(
        "cd /tmp && runuser -u nobody -- env BUDGETGPU_DRY_RUN=1 sbatch --parsable --wait --nodes=2"
        " --gres=gpu:rtx3090:2 --output=/tmp/torchrun-%j.out /opt/budgetgpu/slurm/torchrun.sbatch train.py --steps 5"
    )
    # The batch step runs on the job's first node, which writes the output there.
    lines = sorted(host("slurm-node1").file(f"/tmp/torchrun-{job.strip()}.out").content_string.strip().splitlines())
    first = _address("slurm-node1")
    assert [line.split(":")[0] for line in lines] == list(NODES)
    for line, name in zip(lines, NODES, strict=True):
        assert f"--rdzv-endpoint={first}:" in line
        assert f"--rdzv-conf=is_host={int(name == NODES[0])} " in line
        assert f"--local-addr={_address(name)}" in line
        assert "--nnodes=2 --nproc-per-node=2" in line
        assert line.endswith(" train.py --steps 5")


def job_state(job: str) -> str:
    shown = host(CONTROLLER).run(f"scontrol show job {job}").stdout
    return next((part.split("=", 1)[1] for part in shown.split() if part.startswith("JobState=")), "GONE")


def owners(name: str) -> str:
    return host(name).check_output("nft list set inet budgetgpu_slurm_jobs owners")


def connects(name: str, user: str, address: str, port: int) -> subprocess.CompletedProcess:
    return host(name).run(f"runuser -u {user} -- timeout 5 bash -c 'exec 3<>/dev/tcp/{address}/{port}'")


def assert_the_jobs_ports_are_its_users_alone(job: str) -> None:
    """While nobody's job trains: its two ports (the pair of the range its id picks: 29600 + 2 * (id mod 200) and
    the next) are nobody's (uid 65534) on both nodes; nobody connects to them, ana (another Slurm user) is reset,
    from the node that listens, from the other node and from the controller."""
    rendezvous = 29600 + 2 * (int(job) % 200)
    for name in NODES:
        found = owners(name)
        assert f"65534 . {rendezvous} " in found and f"65534 . {rendezvous + 1} " in found, (name, found)
    # The rendezvous on the first node; the workers' store on the node that is rank 0 of the rendezvous.
    listening = [(NODES[0], rendezvous)] + [
        (name, rendezvous + 1) for name in NODES if f":{rendezvous + 1} " in host(name).run("ss -Htln").stdout
    ]
    assert len(listening) == 2, listening
    for name, port in listening:
        address = _address(name)
        for client in NODES:
            tried = connects(client, "nobody", address, port)
            assert tried.rc == 0, (client, name, port, tried.stderr)
        for client in (*NODES, CONTROLLER):
            tried = connects(client, "ana", address, port)
            assert tried.rc != 0 and "refused" in tried.stderr, (client, name, port, tried.rc, tried.stderr)


def test_a_requeued_torchrun_job_resumes_from_its_checkpoint() -> None:
    """A 2-node torchrun job through the batch script of slurm_jobs' entry, which runs torchrun.sbatch (the
    example train_ddp.py, gloo on CPU, one process per node) that Slurm requeues after its first
    checkpoint: the requeue's SIGTERM stops it at one step with a
    checkpoint, the same job id starts again and resumes from that step, and finishes. Its checkpoints lie in
    <slurm_checkpoint_root>/nobody/<job>, nobody's, on both nodes. Its environment file (group nogroup) was read.
    Its two ports are nobody's alone while it trains, and for 5 minutes more when it has ended."""
    if not host("slurm-node1").file("/opt/budgetgpu/venv/bin/torchrun").exists:
        # Only where converge made no venv on purpose (Debian 13: no torch for its Python in the wheelhouse).
        assert host("slurm-node1").file("/etc/debian_version").content_string.startswith("13"), "no torch venv"
        pytest.skip("no torch venv on Debian 13 nodes (the wheelhouse holds torch for Python 3.11 only)")
    for name in NODES:
        subprocess.run(["docker", "exec", name, "install", "-d", "-m", "0755", "/tmp/job"], check=True)
        # The trainer only: its helper is the node package's (budgetgpu_node.straggler), on the job venv's
        # path by python_env's .pth. docker cp cannot write into the node's /tmp (a tmpfs): through cat.
        subprocess.run(
            ["docker", "exec", "-i", name, "sh", "-c", "umask 022 && cat > /tmp/job/train_ddp.py"],
            input=(EXAMPLE / "train_ddp.py").read_bytes(),
            check=True,
        )
    ctl, node = host(CONTROLLER), host("slurm-node1")
    # slurm_jobs' entry (molecule.yml): 2 nodes, one rtx3090 each, checkpoints every 20 steps from its environment.
    job = ctl.check_output(
        "cd /tmp && runuser -u nobody -- sbatch --parsable --output=/tmp/train-%j.out"
        " /opt/budgetgpu/slurm/jobs/resume-demo.sbatch"
    ).strip()
    shown = ctl.check_output(f"scontrol show job {job}")
    assert re.search(r"JobName=resume-demo\s", shown) and re.search(r"TimeLimit=00:15:00\s", shown), shown

    def output() -> str:
        return node.run(f"cat /tmp/train-{job}.out").stdout

    def wait(done, what: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not done():
            assert time.monotonic() < deadline, f"job {job}: {what} (state {job_state(job)}): {output()[-3000:]}"
            time.sleep(1)

    try:
        wait(lambda: "checkpoint step=" in output(), "no checkpoint", 240)
        assert_the_jobs_ports_are_its_users_alone(job)
        ctl.check_output(f"scontrol requeue {job}")
        # A requeued batch job may start again only after AuthInfo's cred_expire (120 s by default): a person
        # may start it at once, as here.
        wait(lambda: job_state(job) == "PENDING", "not pending after the requeue", 90)
        ctl.check_output(f"scontrol update JobId={job} StartTime=now")
        wait(lambda: job_state(job) in ("COMPLETED", "FAILED", "CANCELLED", "GONE"), "did not end", 300)
    finally:
        ctl.run(f"scancel {job}")
    text = output()
    assert job_state(job) == "COMPLETED", text[-3000:]
    stopped = re.search(r"stopped at step (\d+)", text)
    assert stopped, text[-3000:]
    step = int(stopped[1])
    assert step >= 20 and f"checkpoint step={step} " in text, text[-3000:]
    assert f"resumed from step {step} " in text[stopped.end() :], text[-3000:]
    assert "finished at step 150" in text, text[-3000:]
    mine = "/var/lib/budgetgpu/slurm-checkpoints/nobody"
    for name in NODES:
        # Root's, the sticky root only where users may write: its parent was made 1777 by the file module once.
        # Root's alone: the Prolog (root) made nobody's directory there, no user could take its name first.
        parents = host(name).check_output("stat -c '%U %a' /var/lib/budgetgpu /var/lib/budgetgpu/slurm-checkpoints")
        assert parents.splitlines() == ["root 755", "root 755"], (name, parents)
        found = host(name).run(f"stat -c '%U %a' {mine} && ls {mine}/{job}")
        assert found.rc == 0 and found.stdout.startswith("nobody 700\n"), (name, found.stdout, found.stderr)
        assert "step-00000150.pt" in found.stdout, (name, found.stdout)
    # The Epilog left the job's ports to nobody 5 minutes more, not 30 days (it may still run when the job shows
    # COMPLETED): the requeued run, started again at once, got no Prolog from slurmd and trained all the same.
    rendezvous = 29600 + 2 * (int(job) % 200)
    deadline = time.monotonic() + 20
    while any(
        re.findall(rf"65534 \. (?:{rendezvous}|{rendezvous + 1}) timeout (\S+)", owners(name)) != ["5m", "5m"]
        for name in NODES
    ):
        assert time.monotonic() < deadline, [owners(name) for name in NODES]
        time.sleep(1)


def test_slurmdbd_accounts_each_job_with_its_gpus_and_keeps_its_password_to_itself() -> None:
    ctl = host(CONTROLLER)
    conf = ctl.file("/etc/slurm/slurmdbd.conf")
    assert (conf.user, conf.group, conf.mode) == ("slurm", "slurm", 0o600)
    password = (STATE / "slurm" / "slurmdbd.password").read_text().strip()
    assert (STATE / "slurm" / "slurmdbd.password").stat().st_mode & 0o777 == 0o600
    assert len(password) == 32 and f"StoragePass={password}\n" in ctl.check_output("cat /etc/slurm/slurmdbd.conf")
    # MariaDB answers on the loopback only; slurmdbd's port is the firewall's (the test above).
    local = [line.split()[3] for line in ctl.check_output("ss -Htln 'sport = :3306'").splitlines()]
    assert local and all(address.startswith(("127.0.0.1:", "[::1]:")) for address in local), local
    job = ctl.check_output(
        "cd /tmp && runuser -u nobody -- sbatch --parsable --wait -w slurm-node1 --gres=gpu:rtx3090:2"
        " --output=/dev/null --wrap 'sleep 1'"
    ).strip()
    # slurmctld sends a short job's end and start to slurmdbd in either order: until both arrived, sacct may show
    # the job completed as root's (uid 0). The record's user is the submitter's once it is whole.
    query = f"sacct -j {job} --allocations --noheader --parsable2 --format=JobID,User,UID,State,AllocTRES"
    whole = f"{job}|nobody|65534|COMPLETED|"
    deadline = time.monotonic() + 60
    while not (row := ctl.run(query).stdout).startswith(whole):
        assert time.monotonic() < deadline, f"sacct has no whole record of job {job}: {row!r}"
        time.sleep(2)
    assert "gres/gpu=2" in row, row
    # A user on a GPU node asks slurmdbd through the firewall, as a cluster host.
    assert whole in host("slurm-node1").check_output(f"runuser -u nobody -- {query}")


def test_a_teams_jobs_queue_for_the_gpus_and_each_user_keeps_their_checkpoints_to_themselves() -> None:
    """ana's job holds node1's four RTX 3090s; ben's batch job asks for four on node1 too: it waits in the queue
    (Resources) until hers ends, then runs. Each user's checkpoint directory is their own, which the other
    cannot read."""
    ctl = host(CONTROLLER)
    hers = ctl.check_output(
        "cd /tmp && runuser -u ana -- sbatch --parsable -w slurm-node1 --gres=gpu:rtx3090:4 --output=/dev/null"
        " --wrap 'sleep 20'"
    ).strip()
    his = ctl.check_output(
        "cd /tmp && runuser -u ben -- env BUDGETGPU_DRY_RUN=1 sbatch --parsable -w slurm-node1 --gres=gpu:rtx3090:4"
        " --output=/tmp/ben-%j.out /opt/budgetgpu/slurm/torchrun.sbatch train.py"
    ).strip()
    expected = {hers: ["ana", "RUNNING", "None"], his: ["ben", "PENDING", "Resources"]}
    deadline = time.monotonic() + 30
    while (queue := ctl.check_output(f"squeue --noheader --jobs {hers},{his} --format='%i %u %T %r'")) and {
        line.split()[0]: line.split()[1:] for line in queue.splitlines()
    } != expected:
        assert time.monotonic() < deadline, (queue, expected)
        time.sleep(1)
    ctl.check_output(
        "cd /tmp && runuser -u ana -- env BUDGETGPU_DRY_RUN=1 sbatch --parsable --wait -w slurm-node2"
        " --gres=gpu:rtx3090:1 --output=/dev/null /opt/budgetgpu/slurm/torchrun.sbatch train.py"
    )
    deadline = time.monotonic() + 90
    while job_state(his) not in ("COMPLETED", "FAILED", "CANCELLED", "GONE"):
        assert time.monotonic() < deadline, f"ben's job {his}: {job_state(his)}"
        time.sleep(1)
    assert job_state(his) == "COMPLETED", host("slurm-node1").run(f"cat /tmp/ben-{his}.out").stdout
    times = ctl.check_output(f"sacct -j {hers},{his} --allocations --noheader --parsable2 --format=JobID,Start,End")
    (_unused, _start, her_end), (_unused, his_start, _end) = sorted(
        (line.split("|") for line in times.splitlines()), key=lambda row: row[0] != hers
    )
    assert his_start >= her_end, times
    root = "/var/lib/budgetgpu/slurm-checkpoints"
    for user, node in (("ben", "slurm-node1"), ("ana", "slurm-node2")):
        assert host(node).check_output(f"stat -c '%U %a' {root}/{user}") == f"{user} 700"
    assert host("slurm-node1").run(f"runuser -u ana -- ls {root}/ben").rc != 0


def test_a_checkpoint_root_in_a_directory_users_can_write_is_refused_and_nothing_changes(playbook) -> None:
    # /tmp is 1777: a user could have made /tmp/budgetgpu-ckpt a link before root makes it.
    done = playbook("slurm.yml", "-e", "slurm_checkpoint_root=/tmp/budgetgpu-ckpt", "--tags", "probe,slurm_preflight")
    assert done.returncode != 0
    said = "slurm-node1: slurm_checkpoint_root: found /tmp/budgetgpu-ckpt in /tmp (owner root, group root, mode 1777)"
    assert said in done.stdout, done.stdout[-2000:]
    assert not host("slurm-node1").file("/tmp/budgetgpu-ckpt").exists


def test_each_jobs_gpu_energy_lands_in_a_root_owned_file() -> None:
    job = host(CONTROLLER).check_output(
        "cd /tmp && runuser -u nobody -- sbatch --parsable --wait -w slurm-node1 --gres=gpu:2 --wrap 'sleep 2'"
    )
    node = host("slurm-node1")
    jobs_dir = node.file("/var/lib/budgetgpu/slurm-jobs")
    assert (jobs_dir.user, jobs_dir.mode) == ("root", 0o755)
    record_file = node.file(f"/var/lib/budgetgpu/slurm-jobs/{job.strip()}.json")
    # sbatch --wait may return while the epilog still runs (the job is completing).
    deadline = time.monotonic() + 60
    while "kwh" not in (record := json.loads(record_file.content_string or "{}")):
        assert time.monotonic() < deadline, f"no end record: {record}"
        time.sleep(1)
    assert (record_file.user, record_file.group, record_file.mode) == ("root", "root", 0o644)
    assert (record["job"], record["user"], len(record["gpus"])) == (job.strip(), "nobody", 2)
    # The simulated GPUs have NVML's energy counter: both of the job's GPUs are counted, none other.
    assert len(record["joules"]) == 2 and all(j >= 0 for j in record["joules"].values())
    assert record["seconds"] >= 2


PROBE_JOBS = """
- name: What safe mode sees on the node
  hosts: slurm-node1
  gather_facts: false
  become: true
  tasks:
    - name: Probe the node as the nightly run does
      ansible.builtin.include_role:
        name: budgetgpu.cluster.probe
      vars:
        budgetgpu_safe_mode: true
    - name: Say what counts as running
      ansible.builtin.debug:
        msg: "jobs_active={{ budgetgpu_jobs_active | to_json }} disruption_allowed={{ budgetgpu_disruption_allowed }}"
"""


def slurmd_pid() -> str:
    """slurmd's process on slurm-node1 (systemd's MainPID: Slurm 24.11 under systemd writes no pid file)."""
    return host("slurm-node1").check_output("systemctl show --property=MainPID --value slurmd")


def sleeping_job_on_node1() -> str:
    """Submit a job of nobody's that sleeps on slurm-node1; return its id once it has a step there."""
    job = host(CONTROLLER).check_output(
        "cd /tmp && runuser -u nobody -- sbatch --parsable -w slurm-node1 --output=/dev/null --wrap 'sleep 300'"
    )
    job, deadline = job.strip(), time.monotonic() + 60
    # `scontrol listpids` exits 1 on a node without a job step: read its output whatever the status.
    while f" {job} " not in host("slurm-node1").run("scontrol listpids").stdout:
        assert time.monotonic() < deadline, f"job {job} has no step on slurm-node1"
        time.sleep(1)
    return job


def test_a_running_slurm_job_holds_off_the_nightly_runs_disruptions(tmp_path, playbook) -> None:
    """A Slurm job on the node is a running job to safe mode, as a job unit is: the nightly run's driver
    change or reboot waits for it (plugins/plugin_utils/disruption.py)."""
    job = sleeping_job_on_node1()
    try:
        (tmp_path / "probe-jobs.yml").write_text(PROBE_JOBS)
        done = playbook(str(tmp_path / "probe-jobs.yml"))
        assert done.returncode == 0, done.stdout[-2000:]
        assert f'jobs_active=["slurm job {job}"] disruption_allowed=False' in done.stdout, done.stdout[-2000:]
    finally:
        host(CONTROLLER).run(f"scancel {job}")


def test_the_report_sums_a_jobs_gpu_energy_over_its_nodes_and_per_user(playbook) -> None:
    job = (
        host(CONTROLLER)
        .check_output(
            "cd /tmp && runuser -u nobody -- sbatch --parsable --wait --nodes=2 --gres=gpu:rtx3090:1 --wrap 'sleep 2'"
        )
        .strip()
    )
    for name in NODES:  # sbatch --wait may return while an epilog still runs
        record = host(name).file(f"/var/lib/budgetgpu/slurm-jobs/{job}.json")
        deadline = time.monotonic() + 60
        while "kwh" not in json.loads(record.content_string or "{}"):
            assert time.monotonic() < deadline, f"{name}: no end record of job {job}"
            time.sleep(1)
    done = playbook("slurm_report.yml")
    assert done.returncode == 0, done.stdout[-2000:]
    assert f"job {job} (nobody, 2 GPU(s) on slurm-node1, slurm-node2): " in done.stdout, done.stdout[-2000:]
    assert "Slurm jobs: " in done.stdout and "user nobody: " in done.stdout and "not read" not in done.stdout


def node_line(name: str) -> str:
    """scontrol's State= and Reason= of a node, as one string. Reason= holds spaces and runs to the end of
    its line ("Reason=budgetgpu: pending ... [root@2026-12-02T06:10:11]")."""
    shown = host(CONTROLLER).check_output(f"scontrol show node {name}")
    parts = []
    for row in shown.splitlines():
        row = row.strip()
        parts += [row] if row.startswith("Reason=") else [part for part in row.split() if part.startswith("State=")]
    return " ".join(parts)


def test_drain_first_holds_a_slurmd_restart_for_a_job_then_applies_it_and_resumes(playbook) -> None:
    """slurm_drain_for_changes: a configuration slurmd has not read waits for the job on the node (no
    restart), the node is drained with budgetgpu's reason so no new job lands there; once the job ends a
    run restarts slurmd and the node is resumed (plugins/plugin_utils/disruption.py slurm_drain_action)."""
    node = host("slurm-node1")
    args = ("-e", "budgetgpu_safe_mode=true", "-e", "slurm_drain_for_changes=true",
            "--tags", "probe,slurm_run,slurm_drain")  # fmt: skip
    job = sleeping_job_on_node1()
    try:
        pid = slurmd_pid()
        node.check_output("touch /etc/slurm/cgroup.conf")
        done = playbook("slurm.yml", *args)
        assert done.returncode == 0, done.stdout[-3000:]
        assert slurmd_pid() == pid, "slurmd restarted under a running job"
        line = node_line("slurm-node1")
        assert (
            "DRAIN" in line and "Reason=budgetgpu: pending slurm: slurmd restart pending: cgroup.conf changed" in line
        )
        host(CONTROLLER).check_output(f"scancel {job}")
        deadline = time.monotonic() + 60
        while f" {job} " in node.run("scontrol listpids").stdout:
            assert time.monotonic() < deadline, f"job {job} still has a step after scancel"
            time.sleep(1)
        for _run in range(2):  # the restart, then the resume (one run may do both)
            done = playbook("slurm.yml", *args)
            assert done.returncode == 0, done.stdout[-3000:]
            if "DRAIN" not in node_line("slurm-node1"):
                break
        assert slurmd_pid() != pid, "slurmd did not read the changed configuration"
        # Only the state: Slurm 24.11 (Debian 13) keeps a resumed node's last reason, 22.05 clears it.
        assert "DRAIN" not in node_line("slurm-node1")
    finally:
        host(CONTROLLER).run(f"scancel {job}")
        if "DRAIN" in node_line("slurm-node1") and "Reason=budgetgpu: pending" in node_line("slurm-node1"):
            host(CONTROLLER).run("scontrol update NodeName=slurm-node1 State=RESUME")
