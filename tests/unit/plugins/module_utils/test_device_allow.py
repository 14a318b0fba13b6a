"""device_allow: /proc/devices and DeviceAllow= read as systemd reads them, NVIDIA groups left closed."""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils import device_allow

PROC_DEVICES = Path(__file__).resolve().parents[4] / "tests" / "fixtures" / "proc-devices"
# torchrun_device_allow before issue 12: it names the 195 group as drivers up to 535 register it.
BEFORE_ISSUE_12 = [
    "char-nvidia-frontend rw",
    "char-nvidia-uvm rw",
    "char-nvidia-caps rw",
    "char-nvidia-nvswitch rw",
    "char-infiniband_verbs rw",
    "/dev/infiniband/rdma_cm rw",
]


def fixture(name: str) -> str:
    return (PROC_DEVICES / f"{name}.txt").read_text()


def test_parse_proc_devices_keeps_sections_names_with_slashes_and_shared_majors():
    groups = device_allow.parse_proc_devices(fixture("580-open"))
    assert (4, "/dev/vc/0") in groups["char"] and (202, "cpu/msr") in groups["char"]
    assert [name for major, name in groups["char"] if major == 195] == ["nvidia", "nvidia-modeset", "nvidiactl"]
    assert (259, "blkext") in groups["block"] and all(name != "blkext" for _m, name in groups["char"])
    # Text outside a section, or after the blank line that ends one, is not a group.
    odd = "195 nvidia\nCharacter devices:\n  1 mem\nnot a line\n\n196 stray\n"
    assert device_allow.parse_proc_devices(odd) == {"char": [(1, "mem")], "block": []}


def test_parse_device_allow_defaults_the_access_to_rwm_and_an_empty_entry_resets():
    assert device_allow.parse_device_allow(["char-nvidia rw", "/dev/nvidia0", "block-loop r"]) == [
        device_allow.Rule("char", "nvidia", "rw"),
        device_allow.Rule("path", "/dev/nvidia0", "rwm"),
        device_allow.Rule("block", "loop", "r"),
    ]
    assert device_allow.parse_device_allow(["char-nvidia rw", "", "char-nvidia-uvm"]) == [
        device_allow.Rule("char", "nvidia-uvm", "rwm")
    ]


def test_nvidia_groups_are_the_char_groups_named_nvidia_something():
    groups = device_allow.parse_proc_devices(fixture("550"))
    assert device_allow.nvidia_groups(groups) == [
        (195, "nvidia"),
        (195, "nvidiactl"),
        (234, "nvidia-caps-imex-channels"),
        (235, "nvidia-nvswitch"),
        (236, "nvidia-nvlink"),
        (237, "nvidia-caps"),
        (508, "nvidia-uvm"),
    ]


def test_the_list_before_issue_12_leaves_a_550_driver_gpu_closed():
    uncovered = device_allow.uncovered_groups(BEFORE_ISSUE_12, fixture("550"))
    assert (195, "nvidia") in uncovered and (195, "nvidiactl") in uncovered
    message = device_allow.uncovered_message(uncovered)
    assert message.startswith("DeviceAllow= does not open the NVIDIA device groups nvidia (major 195), nvidiactl")
    # One entry per major; the GPU major by /dev/nvidiactl's node alone: char-nvidia would open every GPU (issue 40).
    assert "add /dev/char/195:255 rw, char-nvidia-caps-imex-channels rw, char-nvidia-nvlink rw to" in message
    assert device_allow.uncovered_groups(BEFORE_ISSUE_12, fixture("535")) == [(235, "nvidia-nvlink")]


@pytest.mark.parametrize(
    ("entries", "uncovered"),
    [
        (["char-nvidia*"], []),  # fnmatch, as systemd matches groups
        (["char-*"], []),
        (["char-195 rw", "char-nvidia-?vm rw"], "all but 195 and uvm"),
        (["char-nvidia r", "char-nvidia-* rw"], [(195, "nvidia"), (195, "nvidiactl")]),  # read-only is not enough
        (["block-nvidia* rw"], "all"),
        (["/dev/nvidia0 rw", "/dev/nvidiactl rw"], "all"),  # nodes open minors, not groups
        # The GPU major counts as open with /dev/nvidiactl's node: a unit opens its GPUs there one by one.
        (["/dev/char/195:255 rw", "/dev/char/195:0 rw"], "all but 195"),
    ],
)
def test_uncovered_groups_follow_systemd_matching(entries, uncovered):
    everything = device_allow.nvidia_groups(device_allow.parse_proc_devices(fixture("550")))
    if uncovered == "all":
        expected = everything
    elif uncovered == "all but 195":
        expected = [(major, name) for major, name in everything if major != 195]
    elif uncovered == "all but 195 and uvm":
        expected = [(major, name) for major, name in everything if major != 195 and name != "nvidia-uvm"]
    else:
        expected = uncovered
    assert device_allow.uncovered_groups(entries, fixture("550")) == expected


def test_no_driver_means_nothing_to_open():
    text = "Character devices:\n  1 mem\n136 pts\n\nBlock devices:\n  7 loop\n"
    assert device_allow.uncovered_groups(BEFORE_ISSUE_12, text) == []
    assert device_allow.uncovered_message([]) == "DeviceAllow= opens every NVIDIA device group in /proc/devices"


def test_node_allowed_by_group_major_or_path():
    groups = device_allow.parse_proc_devices(fixture("550"))
    rules = device_allow.parse_device_allow(["char-nvidia rw", "/dev/nvidia-uvm rw", "/dev/char/237:1 rw", "/dev/x"])
    nodes = {"/dev/nvidia-uvm": (508, 0)}
    stat_char = nodes.get
    assert device_allow.node_allowed(rules, groups, 195, 255, stat_char)  # /dev/nvidiactl by the nvidia group
    assert device_allow.node_allowed(rules, groups, 508, 0, stat_char)
    assert not device_allow.node_allowed(rules, groups, 508, 1, stat_char)  # /dev/nvidia-uvm-tools
    assert device_allow.node_allowed(rules, groups, 237, 1, stat_char)
    assert not device_allow.node_allowed(rules, groups, 237, 2, stat_char)
    # A missing path opens nothing (systemd warns and goes on).
    assert device_allow.allowed_nodes(device_allow.parse_device_allow(["/dev/nope rw"]), stat_char) == set()


def test_a_units_gpus_are_those_its_device_allow_opens_as_systemctl_show_prints_it():
    # systemctl show prints one DeviceAllow= line per entry, the last added first.
    job = ["DevicePolicy=closed", "DeviceAllow=char-nvidia-uvm rw", "DeviceAllow=/dev/char/195:255 rw"]
    job.append("DeviceAllow=/dev/char/195:1 rw")
    assert device_allow.unit_gpu_minors(job, fixture("550"), [0, 1, 2, 3]) == {1}
    # A list that names the GPU major's group opens every GPU, as in the unit.
    whole = ["DevicePolicy=closed", "DeviceAllow=char-nvidia rw"]
    assert device_allow.unit_gpu_minors(whole, fixture("550"), [0, 1]) == {0, 1}
    # systemd's default (auto, no list) lets every device through; so does what systemctl could not show.
    assert device_allow.unit_gpu_minors(["DevicePolicy=auto"], fixture("550"), [0, 1]) == {0, 1}
    assert device_allow.unit_gpu_minors([], "", [0, 1]) == {0, 1}
    # A closed policy with no list opens no GPU.
    assert device_allow.unit_gpu_minors(["DevicePolicy=closed"], fixture("550"), [0, 1]) == set()


def test_a_gpus_minor_is_the_probes_minor_number_else_its_index():
    assert device_allow.gpu_minor({"index": 2}) == 2
    assert device_allow.gpu_minor({"index": 2, "minor_number": 5}) == 5
    assert device_allow.gpu_minor({"index": 2, "minor_number": None}) == 2
