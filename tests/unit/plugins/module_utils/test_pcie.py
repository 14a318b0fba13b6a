"""pcie: the sysfs walk, link verdicts and expectations on captured and synthetic trees."""

from __future__ import annotations

import os

import pytest
from ansible_collections.budgetgpu.cluster.plugins.module_utils import pcie


@pytest.mark.parametrize(
    ("text", "gen", "gts"),
    [
        ("32.0 GT/s PCIe", 5, 32.0),
        ("16.0 GT/s PCIe", 4, 16.0),
        ("8.0 GT/s PCIe", 3, 8.0),
        ("8 GT/s", 3, 8.0),
        ("5 GT/s", 2, 5.0),
        ("2.5 GT/s", 1, 2.5),
        ("64.0 GT/s PCIe", 6, 64.0),
        ("Unknown", None, None),
        ("Unknown speed", None, None),
        ("", None, None),
        (None, None, None),
        ("3.0 GT/s", None, 3.0),
    ],
)
def test_parse_speed_reads_every_kernel_spelling(text, gen, gts):
    assert pcie.parse_speed(text) == (gen, gts)


@pytest.mark.parametrize(("text", "width"), [("16", 16), ("x4", 4), (" 1\n", 1), ("0", 0), ("", None), ("N/A", None)])
def test_parse_width(text, width):
    assert pcie.parse_width(text) == width


def test_normalize_bus_id_accepts_nvml_and_short_forms():
    assert pcie.normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert pcie.normalize_bus_id("3b:00.0") == "0000:3b:00.0"
    assert pcie.normalize_bus_id("0000:01:00.0") == "0000:01:00.0"
    # Intel VMD's domains start at 0x10000: kept whole, in NVML's 8-digit form too.
    assert pcie.normalize_bus_id("10000:e1:00.0") == "10000:e1:00.0"
    assert pcie.normalize_bus_id("00010000:E1:00.0") == "10000:e1:00.0"


def test_captured_h200_tree(h200_sysfs):
    facts = pcie.probe_pcie(h200_sysfs)
    assert facts["count"] == 1
    gpu = facts["gpus"][0]
    assert gpu["bus_id"] == "0000:00:06.0"
    assert gpu["device_id"] == "0x2335"
    assert gpu["name"] == "H200"
    assert gpu["link"]["current_gen"] == 5 and gpu["link"]["current_width"] == 16
    assert gpu["link"]["max_speed_gts"] == 32.0
    # Passed through to a VM on the root bus: no port above is visible.
    assert [hop["role"] for hop in gpu["path"]] == ["gpu"]
    assert gpu["effective"] == {"gen": 5, "width": 16, "bandwidth_gbps": 63.008}
    assert gpu["limiting_hop"] == "0000:00:06.0"
    assert gpu["downgraded"] is False and gpu["gen_below_max"] is False and gpu["width_below_max"] is False
    assert gpu["numa_node"] is None  # numa_node reads -1 there
    assert gpu["local_cpus"] == "0-15"


def by_bus(facts):
    return {gpu["bus_id"]: gpu for gpu in facts["gpus"]}


def test_mining_board_tells_slot_limit_from_bad_riser(sim_tree):
    facts = pcie.probe_pcie(sim_tree("rtx3090x4-risers"))
    gpus = by_bus(facts)
    assert facts["count"] == 4  # the four HDMI audio functions are not counted
    assert {bus: (g["effective"]["gen"], g["effective"]["width"]) for bus, g in gpus.items()} == {
        "0000:01:00.0": (3, 16),
        "0000:02:00.0": (3, 4),
        "0000:03:00.0": (3, 4),
        "0000:04:00.0": (3, 1),
    }
    assert [g["downgraded"] for g in gpus.values()] == [False, False, False, True]
    # An x4 slot gives x4: no complaint. The x1 link under an x4 port and an x16 card is the riser.
    assert gpus["0000:02:00.0"]["capable"]["width"] == 4
    assert gpus["0000:02:00.0"]["width_below_max"] is False
    bad = gpus["0000:04:00.0"]
    assert bad["width_below_max"] is True and bad["limiting_hop"] == "0000:00:1d.0"
    assert bad["downgrade_reasons"] == [
        "link 0000:00:1d.0 -> 0000:04:00.0 trained at x1 but both ends support x4: "
        "reseat the card or riser, check the riser cable and the slot"
    ]
    assert [hop["role"] for hop in bad["path"]] == ["root_port", "gpu"]


def test_idle_generation_is_reported_apart_from_width(sim_tree):
    gpus = by_bus(pcie.probe_pcie(sim_tree("mixed-3090-4090")))
    idle = gpus["0000:61:00.0"]
    assert (idle["effective"]["gen"], idle["capable"]["gen"]) == (1, 4)
    assert idle["gen_below_max"] is True and idle["width_below_max"] is False
    assert idle["downgraded"] is False
    x8_slot = gpus["0000:21:00.0"]
    assert x8_slot["effective"]["width"] == 8 and x8_slot["link"]["max_width"] == 16
    assert x8_slot["downgraded"] is False


def test_switch_paths_and_a_bad_upstream_link(sim_tree):
    facts = pcie.probe_pcie(sim_tree("hgx8-switches"))
    gpus = by_bus(facts)
    assert facts["count"] == 8  # NVSwitch (class 0x068000) and NICs are not GPUs
    gpu = gpus["0000:12:00.0"]
    assert [hop["role"] for hop in gpu["path"]] == ["root_port", "switch_upstream", "switch_downstream", "gpu"]
    assert [hop["bus_id"] for hop in gpu["path"]] == ["0000:00:01.0", "0000:10:00.0", "0000:11:00.0", "0000:12:00.0"]
    # Two links: root port -> switch, switch downstream port -> GPU; the switch's inside is no link.
    assert [(link["upstream"], link["downstream"]) for link in gpu["links"]] == [
        ("0000:00:01.0", "0000:10:00.0"),
        ("0000:11:00.0", "0000:12:00.0"),
    ]
    for bus in ("0000:12:00.0", "0000:13:00.0"):
        assert gpus[bus]["downgraded"] is True
        assert gpus[bus]["effective"]["width"] == 8
        assert gpus[bus]["limiting_hop"] == "0000:00:01.0"
    healthy = [g for bus, g in gpus.items() if bus not in ("0000:12:00.0", "0000:13:00.0")]
    assert all(
        not g["downgraded"] and g["effective"] == {"gen": 5, "width": 16, "bandwidth_gbps": 63.008} for g in healthy
    )
    assert gpus["0000:92:00.0"]["numa_node"] == 1 and gpus["0000:92:00.0"]["local_cpus"] == "56-111"


def test_riser_card_with_switch_in_x1_slot_is_not_downgraded(sim_tree):
    gpus = by_bus(pcie.probe_pcie(sim_tree("riser-switch")))
    on_riser = [gpus[f"0000:0{n}:00.0"] for n in range(4, 8)]
    assert all(g["effective"]["width"] == 1 and not g["downgraded"] for g in on_riser)
    assert [g["effective"]["gen"] for g in on_riser] == [2, 1, 2, 2]
    assert [g["gen_below_max"] for g in on_riser] == [False, True, False, False]
    assert gpus["0000:01:00.0"]["downgraded"] is True  # x8 where port and card do x16


def test_odd_strings_audio_and_usb_functions(sim_tree):
    facts = pcie.probe_pcie(sim_tree("odd-strings"))
    gpus = by_bus(facts)
    assert sorted(gpus) == ["0000:01:00.0", "0000:02:00.0", "0000:03:00.0"]
    old = gpus["0000:01:00.0"]  # "5 GT/s" port, "8 GT/s" card
    assert (old["effective"]["gen"], old["capable"]["gen"], old["effective"]["width"]) == (2, 2, 16)
    assert old["downgraded"] is False and old["gen_below_max"] is False
    unknown_port = gpus["0000:02:00.0"]  # the port's current speed reads "Unknown"
    assert unknown_port["effective"]["gen"] == 1 and unknown_port["effective"]["width"] == 1
    assert unknown_port["downgraded"] is False and unknown_port["gen_below_max"] is True
    down = gpus["0000:03:00.0"]
    assert down["effective"]["width"] == 0 and down["effective"]["gen"] is None
    assert down["downgraded"] is True and "is down" in down["downgrade_reasons"][0]


def test_a_single_bridge_between_port_and_gpu_counts_both_links(tmp_path, render_sim):
    # Not how PCIe switches look (they always pair an upstream and downstream port), but trees
    # written by hand often model a riser bridge alone: each adjacent pair is then one link.
    def fn(bdf, parent, cls, cur, curw, mx, mxw, vendor="0x8086"):
        return {
            "bdf": bdf,
            "parent": parent,
            "vendor": vendor,
            "device": "0x2204",
            "class": cls,
            "current_link_speed": cur,
            "current_link_width": curw,
            "max_link_speed": mx,
            "max_link_width": mxw,
        }

    profile = {"pci": [
        fn("0000:00:1c.0", None, "0x060400", "8 GT/s", "4", "8 GT/s", "4"),
        fn("0000:01:00.0", "0000:00:1c.0", "0x060400", "8 GT/s", "4", "8 GT/s", "4"),
        fn("0000:02:00.0", "0000:01:00.0", "0x030000", "8 GT/s", "1", "16 GT/s", "16", vendor="0x10de"),
    ]}  # fmt: skip
    render_sim.render_sysfs(profile, str(tmp_path))
    gpu = pcie.probe_pcie(str(tmp_path))["gpus"][0]
    assert [hop["role"] for hop in gpu["path"]] == ["root_port", "bridge", "gpu"]
    assert len(gpu["links"]) == 2
    assert gpu["downgraded"] is True and gpu["limiting_hop"] == "0000:01:00.0"
    assert gpu["effective"]["width"] == 1


def test_missing_or_empty_sysfs_gives_no_gpus(tmp_path):
    assert pcie.probe_pcie(str(tmp_path / "absent")) == {"sysfs_root": str(tmp_path / "absent"), "count": 0, "gpus": []}


def test_dangling_bus_links_are_skipped(h200_sysfs):
    # links.txt lists seven functions but the capture holds only the GPU's directory.
    assert len(os.listdir(os.path.join(h200_sysfs, "bus", "pci", "devices"))) == 7
    assert pcie.probe_pcie(h200_sysfs)["count"] == 1


def test_expectations_name_host_bus_found_expected_and_what_to_check(sim_tree):
    facts = pcie.probe_pcie(sim_tree("rtx3090x4-risers"))
    assert pcie.check_expectations(facts, "node2", min_width=1) == []
    problems = pcie.check_expectations(facts, "node2", min_width=4)
    assert problems == [
        "node2: GPU 0000:04:00.0 runs PCIe gen3 x1 (limiting hop 0000:00:1d.0), expected x4 or wider: "
        "reseat the card or riser, check the riser cable and that the slot is wired for that width"
    ]
    per_bus = pcie.check_expectations(facts, "node2", expected={"01:00.0": {"width": 16, "gen": 4}})
    assert len(per_bus) == 1
    assert per_bus[0].startswith("node2: GPU 0000:01:00.0 can reach at best PCIe gen3 (now gen3 x16)")
    assert "expected gen4" in per_bus[0]


def test_expected_gen_ignores_idle_drop_but_missing_gpu_fails(sim_tree):
    facts = pcie.probe_pcie(sim_tree("mixed-3090-4090"))
    assert pcie.check_expectations(facts, "ws", expected={"0000:61:00.0": {"gen": 4, "width": 16}}) == []
    missing = pcie.check_expectations(facts, "ws", expected={"0000:81:00.0": {"width": 16}})
    assert missing == ["ws: GPU 0000:81:00.0 is expected but not on the PCI bus: check the card, its power and riser"]
