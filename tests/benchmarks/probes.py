"""Benchmark the probes, without Ansible's start-up. Figures and how to read them: docs/benchmarks/probes.md.

Usage: python tests/benchmarks/probes.py [--runs N]

1. pcie_facts on an 8-GPU tree (tests/fixtures/pcie/hgx8-switches.json rendered in a temp dir):
   budget 20 ms per probe.
2. gpu_facts' probe against the gpu_sim pynvml with the h200 profile (the probe's own cost,
   NVML answering at no cost), beside parsing the reference node's `nvidia-smi -q -x` output.
3. On a node where the real NVML loads: gpu_facts' probe through nvidia-ml-py beside running
   `nvidia-smi -q -x` and parsing it; budget: the probe takes at most half as long.

Exits 1 when a budget is missed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
SIM = REPO / "roles" / "gpu_sim" / "files"
PCIE_BUDGET_MS = 20.0


def load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(function: Callable[[], object], runs: int) -> tuple[float, float]:
    """Return (median, 90th percentile) wall time of function in milliseconds."""
    function()  # warm the page cache and imports once
    samples = []
    for _unused in range(runs):
        start = time.perf_counter()
        function()
        samples.append((time.perf_counter() - start) * 1000)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.9) - 1]


def parse_smi_xml(text: str) -> list[dict[str, str | None]]:
    """What a probe built on nvidia-smi would do: parse `nvidia-smi -q -x` into per-GPU fields."""
    root = ET.fromstring(text)
    gpus = []
    for gpu in root.iter("gpu"):
        gpus.append(
            {
                "bus_id": gpu.get("id"),
                "name": gpu.findtext("product_name"),
                "uuid": gpu.findtext("uuid"),
                "memory": gpu.findtext("fb_memory_usage/total"),
                "gen": gpu.findtext("pci/pci_gpu_link_info/pcie_gen/current_link_gen"),
                "width": gpu.findtext("pci/pci_gpu_link_info/link_widths/current_link_width"),
                "temp": gpu.findtext("temperature/gpu_temp"),
                "power": gpu.findtext("gpu_power_readings/power_draw"),
                "ecc": gpu.findtext("ecc_mode/current_ecc"),
            }
        )
    return gpus


def real_nvml() -> ModuleType | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    pynvml.nvmlShutdown()
    return pynvml


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args(argv)
    pcie = load("pcie", REPO / "plugins" / "module_utils" / "pcie.py")
    nvml_probe = load("nvml_probe", REPO / "plugins" / "module_utils" / "nvml_probe.py")
    render_sim = load("render_sim", SIM / "render_sim.py")
    failed = False
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {args.runs} runs, median / p90 in ms")

    with tempfile.TemporaryDirectory() as tree:
        render_sim.render_sysfs(render_sim.load_profile(str(FIXTURES / "pcie" / "hgx8-switches.json")), tree)
        assert pcie.probe_pcie(tree)["count"] == 8
        median, p90 = timed(lambda: pcie.probe_pcie(tree), args.runs)
        ok = p90 < PCIE_BUDGET_MS
        failed |= not ok
        print(f"pcie_facts probe, 8 GPUs behind 4 switches: {median:.2f} / {p90:.2f}  (budget {PCIE_BUDGET_MS:.0f})")

    os.environ["BUDGETGPU_SIM_PROFILE"] = str(SIM / "profiles" / "h200.json")
    fake = load("pynvml_sim", SIM / "pynvml.py")
    median, p90 = timed(lambda: nvml_probe.probe_nvml(fake), args.runs)
    print(f"gpu_facts probe, simulated H200 (probe's own cost, NVML free): {median:.2f} / {p90:.2f}")
    xml_text = (FIXTURES / "h200-node" / "nvidia-smi-q.xml").read_text()
    median, p90 = timed(lambda: parse_smi_xml(xml_text), args.runs)
    print(f"parsing the H200's nvidia-smi -q -x output: {median:.2f} / {p90:.2f}")

    nvml = real_nvml()
    smi = shutil.which("nvidia-smi")
    if nvml is None or smi is None:
        print("real NVML: not on this machine (no driver); run this on a GPU node for the end-to-end figures")
    else:
        runs = max(10, args.runs // 10)
        probe_ms, _unused = timed(lambda: nvml_probe.probe_nvml(nvml), runs)

        def smi_and_parse() -> None:
            done = subprocess.run([smi, "-q", "-x"], capture_output=True, text=True, check=True)
            parse_smi_xml(done.stdout)

        smi_ms, _unused = timed(smi_and_parse, runs)
        ok = probe_ms <= smi_ms / 2
        failed |= not ok
        print(f"real NVML: gpu_facts probe {probe_ms:.1f}, nvidia-smi -q -x + parse {smi_ms:.1f} (budget: half)")
    print("FAILED: a budget was missed" if failed else "all budgets met")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
