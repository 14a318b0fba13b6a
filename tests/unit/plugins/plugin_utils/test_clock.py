"""clock: a node's clock against the control node's, the read's own delay not counted; preflight refuses
more than a minute of skew, naming the host and the skew."""

from __future__ import annotations

import pytest
from ansible_collections.budgetgpu.cluster.plugins.plugin_utils.clock import clock_skew, clock_skew_problems

BEFORE, AFTER = 1_800_000_000.0, 1_800_000_004.5  # the control node's clock around the read: a slow 4.5 s


def test_a_clock_read_inside_the_window_has_no_skew():
    assert clock_skew("1800000002.25", BEFORE, AFTER) == 0.0
    assert clock_skew_problems("node1", BEFORE, BEFORE, AFTER) == []


def test_skew_counts_from_the_nearer_edge_of_the_window():
    assert clock_skew(AFTER + 30, BEFORE, AFTER) == 30.0
    assert clock_skew(BEFORE - 12.5, BEFORE, AFTER) == -12.5


@pytest.mark.parametrize(
    ("node", "expected"),
    [(AFTER + 60, []), (BEFORE - 60, []), (AFTER + 61, ["61 s ahead of"]), (BEFORE - 400, ["400 s behind"])],
)
def test_more_than_a_minute_either_way_is_refused_naming_host_and_skew(node, expected):
    problems = clock_skew_problems("node2", str(node), BEFORE, AFTER)
    assert len(problems) == len(expected)
    for problem, words in zip(problems, expected, strict=True):
        assert problem.startswith(f"node2: clock is {words} the control node's, expected at most 60 s of skew")
        assert "budgetgpu_ntp_servers" in problem


def test_a_clock_that_is_not_a_number_is_named_not_guessed():
    with pytest.raises(ValueError, match=r"node3: node clock: found 'Thu Jan  1', expected seconds since the epoch"):
        clock_skew_problems("node3", "Thu Jan  1", BEFORE, AFTER)
    with pytest.raises(ValueError, match="node3: the control node's clock went back during the read"):
        clock_skew_problems("node3", BEFORE, AFTER, BEFORE)
