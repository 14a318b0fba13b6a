"""A Slurm job's GPU energy without slurmdbd (role slurm's Prolog and Epilog, run by slurmd as root):
the NVML energy counters of the job's GPUs at its start and end, and the joules between them; and what
root writes for a job, by descriptor in directories only root may write (its record, the user's
checkpoint directory).

Plain Python, stdlib only at import: playbooks/slurm_report.yml runs it on each node with the node venv's python,
`-I -m budgetgpu_node.slurm_energy SINCE`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import stat
from typing import Any

# slurmd's SLURM_JOB_GPUS: the device minors of the job's GPUs on this node ("0,2": Slurm writes the number
# of each gres.conf File=/dev/nvidiaN, not a position); nothing else is read from the job.
_MINORS = re.compile(r"^\d+(,\d+)*$")
_JOB_ID = re.compile(r"^\d+$")
# Never "." or "..": the name becomes a directory under the checkpoint root.
_USER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}$")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class Refused(Exception):
    """A directory or file root may not write through; the message names it and what was found."""


def job_identity(env: dict[str, str]) -> dict[str, Any] | None:
    """Return {job, user, uid, gpus [device minor]} from slurmd's Prolog/Epilog environment, or None where
    the job id or user is not what slurmd gives (nothing is recorded then). uid is SLURM_JOB_UID (None
    where slurmd gave none)."""
    job, user = env.get("SLURM_JOB_ID", ""), env.get("SLURM_JOB_USER", "")
    if not _JOB_ID.match(job) or not _USER.match(user):
        return None
    gpus = env.get("SLURM_JOB_GPUS", "")
    uid = env.get("SLURM_JOB_UID", "")
    return {
        "job": job,
        "user": user,
        "uid": int(uid) if _JOB_ID.match(uid) else None,
        "gpus": [int(i) for i in gpus.split(",")] if _MINORS.match(gpus) else [],
    }


def gpu_energy(nvml: Any) -> list[dict[str, Any]]:
    """Return [{index, minor, uuid, joules}] of every GPU NVML lists: minor the driver's device minor
    (/dev/nvidia<minor>, what Slurm's SLURM_JOB_GPUS names; None where NVML cannot say), joules its
    total-energy counter (None for a GPU without one). NVML failing to start gives []. Run in the Prolog's
    child process, which the Prolog gives up on at its deadline (a GPU off the bus hangs NVML)."""
    # Imported here: the report runs this file alone, without its package.
    from . import nvml_probe

    gpus: list[dict[str, Any]] = []
    try:
        with nvml_probe.session(nvml):
            reader = nvml_probe.Reader(nvml)
            count = reader.get("count", "nvmlDeviceGetCount")
            for index in range(count if isinstance(count, int) else 0):
                handle = reader.get("handle", "nvmlDeviceGetHandleByIndex", index)
                if not nvml_probe.known(handle):
                    continue
                uuid = reader.get("uuid", "nvmlDeviceGetUUID", handle)
                minor = reader.get("minor", "nvmlDeviceGetMinorNumber", handle)
                millijoules = reader.get("energy", "nvmlDeviceGetTotalEnergyConsumption", handle)
                if not isinstance(uuid, (str, bytes)):
                    continue
                gpus.append(
                    {
                        "index": index,
                        "minor": minor if isinstance(minor, int) else None,
                        "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                        "joules": round(millijoules / 1000, 3) if isinstance(millijoules, int) else None,
                    }
                )
    except nvml.NVMLError:
        return []
    return gpus


def job_counters(gpus: list[dict[str, Any]], minors: list[int]) -> dict[str, float]:
    """Return {uuid: joules} of the job's GPUs: those of gpus (gpu_energy) whose device minor is one of
    Slurm's minors, each by its UUID. Where NVML gives no minor the NVML index stands in, as gres.conf's
    File= does (the driver numbers GPUs in bus order, as NVML does). A GPU without a counter is left out:
    it is never replaced by its neighbour."""
    wanted = set(minors)
    return {
        str(gpu["uuid"]): float(gpu["joules"])
        for gpu in gpus
        if isinstance(gpu, dict)
        and (gpu.get("minor") if gpu.get("minor") is not None else gpu.get("index")) in wanted
        and isinstance(gpu.get("joules"), (int, float))
        and gpu.get("uuid")
    }


def _refuse_unless_mine(fd: int, path: str) -> None:
    info = os.fstat(fd)
    if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.close(fd)
        raise Refused(
            f"{path}: owned by uid {info.st_uid} with mode {stat.filemode(info.st_mode)}, expected uid "
            f"{os.geteuid()}'s alone (0755): a directory others may write is not root's to write in"
        )


def open_root_dir(path: str, base: str = "/", create: bool = True) -> int:
    """Return a descriptor of the directory path, walked from base one name at a time without following a
    link, base and each directory on the way this process's user's (root's) and writable by it alone, else
    Refused. With create, the missing ones are made, 0755, by the descriptor of their parent. base is "/"
    on a node (tests start from their own folder)."""
    rest = os.path.relpath(path, base)
    if not os.path.isabs(path) or rest == ".." or rest.startswith("../"):
        raise Refused(f"{path}: expected an absolute path under {base}")
    fd = os.open(base, _DIR_FLAGS)
    walked = base.rstrip("/")
    try:
        _refuse_unless_mine(fd, base)
        for name in [part for part in rest.split("/") if part not in ("", ".")]:
            walked += "/" + name
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=fd)
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                os.fchmod(child, 0o755)
            except OSError as err:
                raise Refused(f"{walked}: cannot open it as a directory: {err.strerror} (a link is refused)") from None
            os.close(fd)
            fd = child
            _refuse_unless_mine(fd, walked)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    return fd


def write_file(dir_fd: int, name: str, data: bytes, mode: int = 0o644) -> None:
    """Write name in the directory atomically, all by dir_fd: a new temporary file (O_EXCL|O_NOFOLLOW,
    created with the final mode, fchmod against the umask), fsync, rename over name. Never a chmod by path."""
    tmp = f".{name}.{secrets.token_hex(8)}"
    fd = os.open(tmp, _NEW_FILE, mode, dir_fd=dir_fd)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def read_file(dir_fd: int, name: str, limit: int) -> bytes | None:
    """Return name's bytes (at most limit) from the directory, None where it is missing, a link, not a
    regular file or larger."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = handle.read(limit + 1)
    return data if len(data) <= limit else None


def make_user_dir(root_fd: int, user: str, uid: int, gid: int) -> str:
    """Make <root>/<user> the user's (uid, gid, 0700) where it is missing: made by root in root's directory
    (root_fd, from open_root_dir: no user may write there, so none can take another's name first), then
    given to the user by its descriptor. Return what was done; Refused where the name is held by someone
    else or is not a directory (left as it is)."""
    if not _USER.match(user):
        raise Refused(f"user {user!r}: expected a user name")
    made = False
    with contextlib.suppress(FileExistsError):
        os.mkdir(user, 0o700, dir_fd=root_fd)
        made = True
    try:
        fd = os.open(user, _DIR_FLAGS, dir_fd=root_fd)
    except OSError as err:
        raise Refused(f"{user}: cannot open it as a directory: {err.strerror} (a link is refused)") from None
    try:
        info = os.fstat(fd)
        # Root's and empty: made now, or by a Prolog stopped before it gave it away (only root writes here).
        if info.st_uid == 0 != uid and (made or not os.listdir(fd)):
            os.fchown(fd, uid, gid)
        elif info.st_uid != uid:
            raise Refused(f"{user}: owned by uid {info.st_uid}, expected {uid} (the job's user): left as it is")
        elif not made:
            return f"{user} is there"
        os.fchmod(fd, 0o700)
        return f"made {user} ({uid}:{gid}, 0700)"
    finally:
        os.close(fd)


def job_env_value(text: str, key: str) -> str | None:
    """Return KEY's value in role slurm's /etc/budgetgpu/slurm-job.env (KEY=VALUE lines), None without it."""
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if sep and name.strip() == key:
            return value.strip()
    return None


def job_ports(job: str, ports: str) -> tuple[int, int]:
    """Return (rendezvous port, workers' store port) of a batch job: the job id picks one of the pairs of
    slurm_rendezvous_ports ("LOW-HIGH"), LOW + 2 * (job mod pairs) and the port after it. The one place of this
    choice: torchrun.sbatch asks it as the job's user, the Prolog as root (the two ports it admits the job's
    user to)."""
    bounds = ports.split("-")
    pairs = (int(bounds[-1]) - int(bounds[0]) + 1) // 2
    if not _JOB_ID.match(job) or pairs < 1:
        raise ValueError(f"job {job!r}, rendezvous ports {ports!r}: expected a job id and a range of 2 ports or more")
    port = int(bounds[0]) + 2 * (int(job) % pairs)
    return port, port + 1


def job_energy(start: dict[str, Any], end_counters: dict[str, float], end_time: float) -> dict[str, Any]:
    """Return the job's record at its end: {job, user, gpus, start, end, seconds, joules {uuid}, kwh}. A GPU
    whose counter went back (a driver reload) or is missing at one end counts for nothing."""
    before = start.get("counters") or {}
    joules = {
        uuid: round(end_counters[uuid] - before[uuid], 3)
        for uuid in before
        if uuid in end_counters and end_counters[uuid] >= before[uuid]
    }
    return {
        **{key: start.get(key) for key in ("job", "user", "gpus")},
        "start": start.get("time"),
        "end": end_time,
        "seconds": round(end_time - float(start.get("time") or end_time), 3),
        "joules": joules,
        "kwh": round(sum(joules.values()) / 3.6e6, 6),
    }


# Where the Prolog and Epilog keep each job's record (root's, 0755; each record 0644).
JOBS_DIR = "/var/lib/budgetgpu/slurm-jobs"
# A record is a few hundred bytes; anything larger is not the epilog's.
MAX_RECORD_BYTES = 64 * 1024
_RECORD_NAME = re.compile(r"^\d+\.json$")


def read_records(directory: str, since: float) -> list[dict[str, Any]]:
    """Return the end records (with kwh) of the jobs that ended at or after since, from the epilog's
    directory: root's, but read as if it were not (no links followed, each file bounded)."""
    records = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    for name in (n for n in names if _RECORD_NAME.match(n)):
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        with os.fdopen(fd, "rb") as handle:
            data = handle.read(MAX_RECORD_BYTES + 1)
        try:
            record = json.loads(data) if len(data) <= MAX_RECORD_BYTES else None
        except ValueError:
            record = None
        if isinstance(record, dict) and "kwh" in record and float(record.get("end") or 0) >= since:
            records.append(record)
    return records


if __name__ == "__main__":
    # playbooks/slurm_report.yml runs this module on each Slurm node: argv SINCE; prints the records.
    import sys

    sys.stdout.write(json.dumps(read_records(JOBS_DIR, float(sys.argv[1]))) + "\n")
