"""The simulated GPU device behind the benchmark (gpu_bench_measure.py --backend sim).

Installed by the budgetgpu.cluster.gpu_sim role beside its drop-in pynvml, on test and demo nodes
only. A simulated node has no CUDA: torch runs each kernel the benchmark asks for on CPU, for
real but small (the same operation, dtype and copy), and the device answers how long the
simulated card would have taken, as CUDA events answer on a real one:

- matmul and device memory copies at the card's rate (RATES, by PCI device id, derated to what a
  benchmark reaches), scaled by the SM clock NVML reports while a slowdown throttle reason is set
  (a fault such as {"throttle": 64, "sm_clock": 1470} makes the card 30% slower, as bad thermal
  paste does);
- host copies at what the GPU's PCIe path carries: the slowest link from its root port down
  (the profile's sysfs attributes, and NVML's current width, which a fault can lower), at
  COPY_EFFICIENCY of the link's rate, or the card's own rate if that is lower. A link's GB/s comes
  from the one table of them, pcie.py's lane_bandwidth_gbps, which the caller passes in.
"""

from __future__ import annotations

import re
from typing import Any

_GEN_BY_GTS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
# Datasheet dense TFLOPS (fp32 on CUDA cores, fp16/bf16 on tensor cores with fp32 accumulate) and
# memory GB/s of the profiles' cards.
RATES = {
    "0x2204": {"fp32": 35.6, "fp16": 71.0, "bf16": 71.0, "memory_gbs": 936.0},  # RTX 3090
    "0x2684": {"fp32": 82.6, "fp16": 165.2, "bf16": 165.2, "memory_gbs": 1008.0},  # RTX 4090
    "0x2335": {"fp32": 67.0, "fp16": 989.0, "bf16": 989.0, "memory_gbs": 4800.0},  # H200
}
FALLBACK_RATES = {"fp32": 20.0, "fp16": 40.0, "bf16": 40.0, "memory_gbs": 500.0}
MATMUL_EFFICIENCY = 0.75
MEMORY_EFFICIENCY = 0.85
COPY_EFFICIENCY = 0.85
# Slowdown reasons (NVML bits) under which the card runs at the SM clock NVML reports:
# sw_power_cap, hw_slowdown, sw_thermal, hw_thermal, hw_power_brake.
SLOWDOWN_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
# The most the CPU computes per call: the kernel runs for real, at a size a CPU does in milliseconds.
CPU_MATMUL_N = 128
CPU_COPY_BYTES = 1 << 20
_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _gen(speed: Any) -> int | None:
    match = re.match(r"\s*([0-9.]+)\s*GT/s", str(speed or ""))
    return _GEN_BY_GTS.get(float(match.group(1))) if match else None


def _width(text: Any) -> int | None:
    return int(text) if str(text).strip().isdigit() else None


def path_link(functions: list[dict[str, Any]], bdf: str) -> tuple[int | None, int | None]:
    """Return the (gen, width) of the slowest link from the root port down to the function bdf."""
    by_bdf = {function["bdf"]: function for function in functions}
    gens, widths = [], []
    function = by_bdf.get(bdf)
    while function is not None:
        gens.append(_gen(function.get("current_link_speed")))
        widths.append(_width(function.get("current_link_width")))
        function = by_bdf.get(function.get("parent") or "")
    known_gens, known_widths = [g for g in gens if g], [w for w in widths if w]
    return (min(known_gens) if known_gens else None, min(known_widths) if known_widths else None)


class SimDevice:
    """The device backend of gpu_bench_measure: matmul_seconds, memory_seconds, copy_seconds."""

    name = "sim"

    def __init__(self, torch: Any, nvml: Any, lane_bandwidth_gbps: Any) -> None:
        self.torch, self.nvml, self.lane_bandwidth_gbps = torch, nvml, lane_bandwidth_gbps

    def _card(self, index: int) -> dict[str, Any]:
        """The card's rates, clock factor and link, as NVML answers now (faults included)."""
        nvml = self.nvml
        nvml.nvmlInit()
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            function = handle.function
            profile = nvml._profile()  # pylint: disable=protected-access
            mask = nvml.nvmlDeviceGetCurrentClocksEventReasons(handle)
            factor = 1.0
            if mask & SLOWDOWN_MASK:
                factor = min(1.0, nvml.nvmlDeviceGetClockInfo(handle, 1) / nvml.nvmlDeviceGetMaxClockInfo(handle, 1))
            gen, width = path_link(profile.get("pci", []), function["bdf"])
            now = nvml.nvmlDeviceGetCurrPcieLinkWidth(handle)
            width = min(w for w in (width, now) if w) if (width or now) else None
        finally:
            nvml.nvmlShutdown()
        rates = RATES.get(str(function.get("device", "")).lower(), FALLBACK_RATES)
        link = self.lane_bandwidth_gbps(gen, width) or 0.0
        return {"rates": rates, "factor": factor, "link_gbs": link}

    def matmul_seconds(self, index: int, dtype: str, n: int, iters: int) -> float:
        torch = self.torch
        size = min(n, CPU_MATMUL_N)
        kind = getattr(torch, _DTYPES[dtype])
        left, right = torch.randn(size, size).to(kind), torch.randn(size, size).to(kind)
        torch.matmul(left, right)
        card = self._card(index)
        return 2 * n**3 * iters / (card["rates"][dtype] * MATMUL_EFFICIENCY * card["factor"] * 1e12)

    def memory_seconds(self, index: int, nbytes: int, iters: int) -> float:
        torch = self.torch
        src = torch.empty(min(nbytes, CPU_COPY_BYTES), dtype=torch.uint8)
        torch.empty_like(src).copy_(src)
        card = self._card(index)
        return 2 * nbytes * iters / (card["rates"]["memory_gbs"] * MEMORY_EFFICIENCY * card["factor"] * 1e9)

    def copy_seconds(self, index: int, direction: str, nbytes: int, iters: int) -> float:
        torch = self.torch
        src = torch.empty(min(nbytes, CPU_COPY_BYTES), dtype=torch.uint8)
        torch.empty_like(src).copy_(src)
        card = self._card(index)
        rate = min(card["link_gbs"] * COPY_EFFICIENCY, card["rates"]["memory_gbs"]) or 1e-3
        return nbytes * iters / (rate * 1e9)
