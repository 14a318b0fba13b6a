"""job_metrics.parse_status: a job's status.json as the watch accepts it (one schema, one bound)."""

from __future__ import annotations

import json

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils import job_metrics

RANK = {"rank": 0, "host": "node1", "local_rank": 0, "step_s": 0.1}


def parse(value) -> dict:
    return job_metrics.parse_status(json.dumps(value).encode())


def test_a_status_as_rank_0_writes_it_comes_back_whole_with_fields_not_in_the_table():
    status = {"step": 4, "steps_per_s": 9.5, "time": 1000.0, "ranks": [RANK], "new_field": {"parts": [1, 2.5]}}
    assert parse(status) == status


def test_1024_ranks_pass_and_1025_are_refused():
    assert len(parse({"ranks": [RANK] * 1024})["ranks"]) == 1024
    with pytest.raises(job_metrics.StatusError, match="1025 ranks, expected at most 1024"):
        parse({"ranks": [RANK] * 1025})


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b'{"step": NaN}', "NaN is not a finite number"),
        (b'{"step": -Infinity}', "-Infinity is not a finite number"),
        (b'{"step": 1e400}', "status.step: inf, expected a finite number"),
        (b'{"step": 9007199254740993}', "an integer of 16 digits, expected at most 2\\*\\*53"),
        (b'{"step": true}', "step is bool 'True', expected a number"),
        (b'{"straggler": 3}', "straggler is int, expected a text"),
        (b'{"ranks": {"0": {}}}', "ranks is dict, expected a list"),
        (b'{"ranks": [7]}', "ranks\\[0\\] is int, expected a mapping"),
        (b'{"ranks": [{"step_s": "fast"}]}', "ranks\\[0\\].step_s is str 'fast', expected a number"),
        (b'{"a": [[[[[1]]]]]}', "nested deeper than 4 levels"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deep to parse|a JSON list"),
        (b'{"step": ', "not JSON"),
        (b"", "not JSON"),
        (b'"text"', "a JSON str, expected a mapping"),
    ],
)
def test_what_is_not_the_schema_is_refused_with_what_was_expected(data, words):
    with pytest.raises(job_metrics.StatusError, match=words):
        job_metrics.parse_status(data)


def test_the_size_bound_is_one_mib():
    assert job_metrics.STATUS_MAX_BYTES == 1 << 20
    with pytest.raises(job_metrics.StatusError, match="1048577 bytes or more, expected at most 1048576"):
        job_metrics.parse_status(b" " * ((1 << 20) - 1) + b"{}")
    assert job_metrics.parse_status(b" " * ((1 << 20) - 2) + b"{}") == {}


def test_lone_surrogates_and_bytes_that_are_not_utf8_are_replaced():
    status = job_metrics.parse_status(b'{"straggler": "slow \\ud800 rank", "ranks": [{"host": "n\xff1"}]}')
    assert status == {"straggler": "slow \ufffd rank", "ranks": [{"host": "n\ufffd1"}]}
    found = job_metrics.samples([{"name": "job\udcff", "status": status, "active": True, "age_s": 1}])
    assert ("budgetgpu_job_running", {"job": "job\ufffd"}, 1.0) in found
    str(found).encode("utf-8")
