"""job_metrics: a job's status file as Prometheus samples (the names the alerts and the dashboard use),
and no rate, ratio or step time left frozen when the job stopped or its status went stale. The text format
is prometheus_client's (tests/unit/scripts/test_gpu_health_script.py)."""

from __future__ import annotations

from ansible_collections.budgetgpu.cluster.plugins.module_utils import job_metrics
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils import jobs

STATUS = {
    "step": 400,
    "steps_per_s": 9.5,
    "world": 4,
    "restarts": 1,
    "straggler": "straggler: rank 2 (node2 GPU 0): 31% slower than the median over the last 200 steps",
    "straggler_ratio": 1.31,
    "straggler_threshold": 0.15,
    "window_steps": 200,
    "ranks": [
        {"rank": 0, "host": "node1", "local_rank": 0, "step_s": 0.1},
        {"rank": 1, "host": "node1", "local_rank": 1, "step_s": 0.1},
        {"rank": 2, "host": "node2", "local_rank": 0, "step_s": 0.131},
        {"rank": 3, "host": "node2", "local_rank": 1, "step_s": 0.1},
    ],
    "time": 1000.0,
}


def lines(samples: list) -> list[str]:
    """The samples as 'name{labels} value' lines, grouped by METRICS' order as the watch writes them."""
    return [
        f"{name}{{{','.join(f'{key}={chr(34)}{val}{chr(34)}' for key, val in labels.items())}}} {value:g}"
        for metric in job_metrics.METRICS
        for name, labels, value in samples
        if name == metric
    ]


def test_a_running_job_exports_its_rate_ratio_threshold_and_each_ranks_step_time():
    text = job_metrics.samples([{"name": "demo", "status": STATUS, "active": True, "age_s": 12.5}])
    assert lines(text) == [
        'budgetgpu_job_running{job="demo"} 1',
        'budgetgpu_job_steps_per_second{job="demo"} 9.5',
        'budgetgpu_job_straggler_ratio{job="demo"} 1.31',
        'budgetgpu_job_straggler_threshold_ratio{job="demo"} 1.15',
        'budgetgpu_job_step_seconds{job="demo",rank="0",node="node1"} 0.1',
        'budgetgpu_job_step_seconds{job="demo",rank="1",node="node1"} 0.1',
        'budgetgpu_job_step_seconds{job="demo",rank="2",node="node2"} 0.131',
        'budgetgpu_job_step_seconds{job="demo",rank="3",node="node2"} 0.1',
        'budgetgpu_job_world_size{job="demo"} 4',
        'budgetgpu_job_last_step{job="demo"} 400',
        'budgetgpu_job_restarts{job="demo"} 1',
        'budgetgpu_job_status_age_seconds{job="demo"} 12.5',
    ]


def test_a_stopped_job_leaves_no_rate_ratio_or_step_time_behind():
    text = job_metrics.samples([{"name": "demo", "status": STATUS, "active": False, "age_s": 12.5}])
    assert lines(text) == [
        'budgetgpu_job_running{job="demo"} 0',
        'budgetgpu_job_last_step{job="demo"} 400',
        'budgetgpu_job_restarts{job="demo"} 1',
        'budgetgpu_job_status_age_seconds{job="demo"} 12.5',
    ]


def test_a_status_older_than_the_bound_is_stale_even_with_the_unit_active():
    stale = "\n".join(lines(job_metrics.samples([{"name": "demo", "status": STATUS, "active": True, "age_s": 900}])))
    assert "budgetgpu_job_steps_per_second" not in stale and 'budgetgpu_job_running{job="demo"} 0' in stale
    fresh = lines(job_metrics.samples([{"name": "demo", "status": STATUS, "active": True, "age_s": 899}], 900))
    assert 'budgetgpu_job_running{job="demo"} 1' in fresh
    # Unknown unit state (systemd did not answer): the age alone decides.
    assert job_metrics.is_live(None, 10) and not job_metrics.is_live(None, 1000)
    assert not job_metrics.is_live(False, 0)


def test_a_status_without_a_straggler_report_yet_exports_what_it_has():
    status = {"step": 10, "steps_per_s": 3.25, "world": 1, "restarts": 0, "time": 5.0}
    text = lines(job_metrics.samples([{"name": "one", "status": status, "active": True, "age_s": 1}]))
    assert not [line for line in text if "straggler_ratio" in line or "step_seconds" in line]
    assert 'budgetgpu_job_steps_per_second{job="one"} 3.25' in text


def test_no_job_gives_no_sample_and_a_name_is_a_label_as_it_is():
    assert job_metrics.samples([]) == []
    found = job_metrics.samples([{"name": 'a"b', "status": {"step": 1}, "active": True, "age_s": 0}])
    assert ("budgetgpu_job_last_step", {"job": 'a"b'}, 1.0) in found


def test_systemctl_show_gives_each_units_state():
    show = "Id=budgetgpu-job-a.service\nActiveState=active\n\nId=budgetgpu-job-b.service\nActiveState=failed\n\n"
    show += "Id=budgetgpu-job-c.service\nActiveState=activating\n\nId=budgetgpu-job-d.service\nActiveState=inactive\n"
    # activating: systemd restarts it after a failure; it runs again, as safe mode counts it.
    assert job_metrics.active_units(show) == {
        "budgetgpu-job-a.service": True,
        "budgetgpu-job-b.service": False,
        "budgetgpu-job-c.service": True,
        "budgetgpu-job-d.service": False,
    }


def test_the_unit_names_and_status_file_are_the_job_models():
    assert job_metrics.UNIT_PREFIX == jobs.UNIT_PREFIX
    assert job_metrics.unit_name("demo") == jobs.unit_name("demo")
    assert job_metrics.STATUS_FILE == jobs.STATUS_FILE


def test_each_ranks_step_breakdown_is_exported_by_part():
    ranks = [{"rank": 0, "host": "node1", "local_rank": 0, "step_s": 0.5, "comm_s": 0.3, "data_s": 0.2, "wall_s": 1.0}]
    text = job_metrics.samples([{"name": "demo", "status": {**STATUS, "ranks": ranks}, "active": True, "age_s": 1.0}])
    found = [line for line in lines(text) if "breakdown" in line or "wall" in line]
    assert found == [
        'budgetgpu_job_step_breakdown_seconds{job="demo",rank="0",node="node1",part="compute"} 0.5',
        'budgetgpu_job_step_breakdown_seconds{job="demo",rank="0",node="node1",part="communication"} 0.3',
        'budgetgpu_job_step_breakdown_seconds{job="demo",rank="0",node="node1",part="data"} 0.2',
        'budgetgpu_job_step_wall_seconds{job="demo",rank="0",node="node1"} 1',
    ]
