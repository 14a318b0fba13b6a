"""The metrics of the training jobs whose rank 0 runs on this node, for node exporter's textfile
collector: the samples and their types and help (METRICS); the watch writes Prometheus' text format
with prometheus_client.

Rank 0 of a job writes its status (straggler.py write_status: step,
steps per second over the last window, each rank's compute seconds per step, the straggler ratio)
to /var/lib/budgetgpu/jobs/<job>/status.json. The health watch (roles/gpu_health/files/gpu-health, an unprivileged
user of its own, each pass) reads those files and the jobs' units' state and writes their metrics
into its own state directory, which a link shows to node exporter: the job's user never writes to
node exporter's directory, and nobody but the watch writes the metrics.

A status that is not live (the job's unit is not running, or the file is older than `stale_after`
seconds: rank 0 writes it at every log line) exports no rate, no ratio and no step times: a stopped
job leaves no gauge frozen at its last value, and Prometheus marks those series stale at the next
scrape. What stays is what is still true: the last step, the file's age, running 0.

A status file is the job's, not the watch's: parse_status holds its schema and bound (one function,
STATUS_FIELDS and RANK_FIELDS its table), and a file it refuses costs that job's metrics only.

Plain standard-library Python with no imports from the rest of the collection (the watch imports it
from the node package, as it imports gpu_metrics). Pure over its inputs.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

# The units of the training jobs: plugin_utils/jobs.py UNIT_PREFIX (a unit test holds them equal).
UNIT_PREFIX = "budgetgpu-job-"
STATUS_FILE = "status.json"
# Seconds after which a status whose unit is active still counts as stale (rank 0 stopped writing:
# a hung job, or a status left behind on a node that is no longer the job's master).
STALE_AFTER_S = 900

# ActiveState values of a unit whose work is alive or about to be: the one definition of "the unit is
# running" (safe mode's running jobs, the start or restart of a changed job or worker, a job's metrics).
# "activating" covers a unit that systemd restarts after a failure (SubState auto-restart): between two
# starts it has no process, but it is work that a Docker or driver restart would disrupt when it comes
# back. "deactivating" is a job saving its checkpoint on the way out. Inactive, failed and maintenance
# units are not running.
RUNNING_STATES = ("active", "reloading", "refreshing", "activating", "deactivating")

# The bound of a status file: rank 0 writes about 100 bytes per rank (a 1024-rank job: about 100 KiB).
STATUS_MAX_BYTES = 1 << 20
STATUS_MAX_RANKS = 1024
# Nesting below the top level: ranks, a rank, a value of a rank (a breakdown's parts).
STATUS_MAX_DEPTH = 4
# The largest integer that stays exact as the float a metric is (2**53), and far below float's overflow.
_MAX_INT = 1 << 53
_SURROGATES = re.compile("[\ud800-\udfff]")

NUMBER, TEXT = "number", "text"
# The status schema (straggler.py write_status): each field the metrics
# read and its kind. A field of another kind refuses the file; fields not listed pass through parse_status
# with their numbers checked finite and their texts cleaned, so a writer may add some before a reader.
STATUS_FIELDS = {
    "time": NUMBER,
    "step": NUMBER,
    "steps_per_s": NUMBER,
    "world": NUMBER,
    "restarts": NUMBER,
    "straggler": TEXT,
    "straggler_ratio": NUMBER,
    "straggler_threshold": NUMBER,
    "window_steps": NUMBER,
    # What the job runs (training.settings_status): the verdict and the dashboard read them.
    "backend": TEXT,
    "gradient_compression": TEXT,
    "bucket_cap_mb": NUMBER,
    "accumulate_steps": NUMBER,
}
# Each entry of "ranks" (a list of at most STATUS_MAX_RANKS mappings).
# step_s is compute; comm_s (communication not hidden), data_s (waiting for data) and wall_s (the whole step)
# are the breakdown (straggler.ranks_status).
RANK_FIELDS = {
    "rank": NUMBER,
    "host": TEXT,
    "local_rank": NUMBER,
    "step_s": NUMBER,
    "comm_s": NUMBER,
    "data_s": NUMBER,
    "wall_s": NUMBER,
}


class StatusError(ValueError):
    """A status file the watch refuses; the message says what was expected and what was found."""


def clean_text(value: Any) -> str:
    """Return value as a text with its lone surrogates replaced (U+FFFD): a job's name from a directory
    that is not UTF-8, a text of its status; such a text cannot be written as UTF-8."""
    return _SURROGATES.sub("\ufffd", str(value))


def _refuse_constant(name: str) -> Any:
    raise StatusError(f"{name} is not a finite number")


def _clean(value: Any, where: str, depth: int) -> Any:
    """Return value with its texts' lone surrogates replaced (U+FFFD; a text that cannot be written as
    UTF-8 would end the metrics file), refusing numbers that are not finite or too large, and nesting."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        if abs(value) > _MAX_INT:
            raise StatusError(f"{where}: an integer of {len(str(abs(value)))} digits, expected at most 2**53")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise StatusError(f"{where}: {value}, expected a finite number")
        return value
    if depth >= STATUS_MAX_DEPTH:
        raise StatusError(f"{where}: nested deeper than {STATUS_MAX_DEPTH} levels")
    if isinstance(value, list):
        return [_clean(item, f"{where}[{n}]", depth + 1) for n, item in enumerate(value)]
    return {_clean(key, where, depth + 1): _clean(item, f"{where}.{key}", depth + 1) for key, item in value.items()}


def _check_fields(mapping: dict[str, Any], fields: dict[str, str], where: str) -> None:
    for key, kind in fields.items():
        value = mapping.get(key)
        if value is None:
            continue
        if kind == NUMBER and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise StatusError(f"{where}{key} is {type(value).__name__} {str(value)[:40]!r}, expected a number")
        if kind == TEXT and not isinstance(value, str):
            raise StatusError(f"{where}{key} is {type(value).__name__}, expected a text")


def parse_status(data: bytes) -> dict[str, Any]:
    """Return a job's status from the bytes of its status.json, or raise StatusError: at most
    STATUS_MAX_BYTES, JSON, a mapping whose STATUS_FIELDS have their kinds, "ranks" a list of at most
    STATUS_MAX_RANKS mappings whose RANK_FIELDS have theirs; every number finite and within 2**53,
    every text with its lone surrogates (and bytes that are not UTF-8) replaced."""
    if len(data) > STATUS_MAX_BYTES:
        raise StatusError(f"{len(data)} bytes or more, expected at most {STATUS_MAX_BYTES}")
    try:
        value = json.loads(data.decode("utf-8", "replace"), parse_constant=_refuse_constant)
    except RecursionError:
        raise StatusError("nested too deep to parse") from None
    except StatusError:
        raise
    except ValueError as error:
        raise StatusError(f"not JSON ({error})") from None
    if not isinstance(value, dict):
        raise StatusError(f"a JSON {type(value).__name__}, expected a mapping")
    ranks = value.get("ranks")
    if ranks is not None and not isinstance(ranks, list):
        raise StatusError(f"ranks is {type(ranks).__name__}, expected a list")
    if ranks and len(ranks) > STATUS_MAX_RANKS:
        raise StatusError(f"{len(ranks)} ranks, expected at most {STATUS_MAX_RANKS}")
    status = _clean(value, "status", 0)
    _check_fields(status, STATUS_FIELDS, "")
    for number, rank in enumerate(status.get("ranks") or []):
        if not isinstance(rank, dict):
            raise StatusError(f"ranks[{number}] is {type(rank).__name__}, expected a mapping")
        _check_fields(rank, RANK_FIELDS, f"ranks[{number}].")
    return status


# name: (type, help). The order of the output.
METRICS = {
    "budgetgpu_job_running": ("gauge", "1 when the job's unit is running and rank 0's status is fresh, else 0."),
    "budgetgpu_job_steps_per_second": ("gauge", "Rank 0's steps per second since its previous status."),
    "budgetgpu_job_straggler_ratio": (
        "gauge",
        "Compute time per step of the slowest rank over the median of all ranks (1.0: even).",
    ),
    "budgetgpu_job_straggler_threshold_ratio": (
        "gauge",
        "Straggler ratio from which the job calls the slowest rank a straggler (1.15: 15% slower).",
    ),
    "budgetgpu_job_step_seconds": (
        "gauge",
        "Each rank's compute seconds per step (forward and backward, apart from the all-reduce) "
        "over the last straggler report window.",
    ),
    "budgetgpu_job_step_breakdown_seconds": (
        "gauge",
        "Each rank's seconds per step by part over the last report window: compute (forward, backward, "
        "optimizer), communication (not hidden by compute, waiting for slower ranks too), data (waiting "
        "for the next batch).",
    ),
    "budgetgpu_job_step_wall_seconds": ("gauge", "Each rank's seconds per step, end to end, over the last window."),
    "budgetgpu_job_world_size": ("gauge", "Ranks of the job."),
    "budgetgpu_job_last_step": ("gauge", "The last step rank 0 reported."),
    "budgetgpu_job_restarts": ("gauge", "Times torchrun restarted the job's workers (in this unit run)."),
    "budgetgpu_job_status_age_seconds": ("gauge", "Seconds since rank 0 last wrote the job's status."),
}


def unit_name(job: str) -> str:
    """Return the systemd unit of a job (plugin_utils/jobs.py unit_name)."""
    return f"{UNIT_PREFIX}{job}.service"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def is_live(active: bool | None, age_s: float, stale_after: float = STALE_AFTER_S) -> bool:
    """Whether a status counts as the job's present: its unit active (None: unknown, the age decides)
    and the file written less than stale_after seconds ago."""
    return active is not False and age_s < stale_after


def job_samples(
    job: str, status: dict[str, Any], active: bool | None, age_s: float, stale_after: float = STALE_AFTER_S
) -> list[tuple[str, dict[str, str], float]]:
    """Return (name, labels, value) of one job's metrics from its status (status.json parsed), its
    unit's state and the file's age. Rates, ratio and step times only while live (is_live)."""
    labels = {"job": job}
    live = is_live(active, age_s, stale_after)
    out: list[tuple[str, dict[str, str], Any]] = [("budgetgpu_job_running", labels, 1 if live else 0)]
    if live:
        threshold = _number(status.get("straggler_threshold"))
        out += [
            ("budgetgpu_job_steps_per_second", labels, _number(status.get("steps_per_s"))),
            ("budgetgpu_job_straggler_ratio", labels, _number(status.get("straggler_ratio"))),
            ("budgetgpu_job_straggler_threshold_ratio", labels, None if threshold is None else 1 + threshold),
            ("budgetgpu_job_world_size", labels, _number(status.get("world"))),
        ]
        for rank in status.get("ranks") or []:
            if isinstance(rank, dict) and _number(rank.get("rank")) is not None:
                rank_labels = {"job": job, "rank": str(rank["rank"]), "node": str(rank.get("host") or "")}
                out.append(("budgetgpu_job_step_seconds", rank_labels, _number(rank.get("step_s"))))
                parts = {"compute": "step_s", "communication": "comm_s", "data": "data_s", "wall": "wall_s"}
                values = {part: _number(rank.get(key)) for part, key in parts.items()}
                if None in values.values():
                    continue  # a status from before the breakdown: its parts alone would mislead
                wall = values.pop("wall")
                for part, value in values.items():
                    out.append(("budgetgpu_job_step_breakdown_seconds", {**rank_labels, "part": part}, value))
                out.append(("budgetgpu_job_step_wall_seconds", rank_labels, wall))
    out += [
        ("budgetgpu_job_last_step", labels, _number(status.get("step"))),
        ("budgetgpu_job_restarts", labels, _number(status.get("restarts"))),
        ("budgetgpu_job_status_age_seconds", labels, round(max(age_s, 0.0), 3)),
    ]
    return [(name, lab, float(value)) for name, lab, value in out if value is not None]


def samples(jobs: list[dict[str, Any]], stale_after: float = STALE_AFTER_S) -> list[tuple[str, dict[str, str], float]]:
    """Return (name, labels, value) of jobs: [{name, status, active, age_s}], label values cleaned
    (clean_text); the watch writes them with prometheus_client under METRICS' types and help (no job, no
    sample: node exporter reads an empty file as no metrics)."""
    out = []
    for job in sorted(jobs, key=lambda j: str(j["name"])):
        # Each job on its own: a status parse_status let through and this code still trips on costs that
        # job's metrics, never the others'.
        try:
            status = job.get("status") or {}
            out += job_samples(clean_text(job["name"]), status, job.get("active"), job["age_s"], stale_after)
        except (TypeError, ValueError, OverflowError, AttributeError):
            continue
    return [(name, {key: clean_text(value) for key, value in labels.items()}, value) for name, labels, value in out]


def unit_running(active_state: Any) -> bool:
    """Whether a unit whose ActiveState is this counts as running (RUNNING_STATES)."""
    return str(active_state) in RUNNING_STATES


def active_units(systemctl_show: str) -> dict[str, bool]:
    """Return {unit: running} from `systemctl show --property=Id,ActiveState UNIT...` (blocks split by
    an empty line; unit_running)."""
    units: dict[str, bool] = {}
    for block in systemctl_show.strip().split("\n\n"):
        fields = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if fields.get("Id"):
            units[fields["Id"]] = unit_running(fields.get("ActiveState"))
    return units
