"""Measure this node's GPUs, one after the other, within a hard time bound per GPU: matmul in the
dtypes the card runs, device memory bandwidth, pinned host-to-device and device-to-host copies,
with NVML's temperature, SM clock, power and throttle reasons sampled during each GPU's run.

`roles/probe/files/gpu-probe --bench` (which playbooks/gpu_bench.yml runs on every node) imports it as
budgetgpu_node.gpu_bench_measure in the job venv's python (torch) and calls measure(), which returns {host, backend,
seconds_per_gpu, gpus: [result]} (gpu_bench.py describes a result). The measuring
takes a device backend: `cuda` times torch's kernels with CUDA events; `sim` (gpu_sim nodes, which
have no CUDA) is gpu_sim's simulated device (sim_device.py beside its drop-in pynvml): torch runs
the same kernels on CPU and the device answers how long the simulated card would take. Everything
else (the NVML sampling, the PCIe link, the analysis) is the same code on both.

Only the standard library at import: torch and pynvml are imported when run.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import threading
import time
from types import ModuleType
from typing import Any

from . import gpu_bench, nvml_probe, pcie

# Where gpu_sim puts its drop-in pynvml and simulated device (gpu_sim role, vars/main.yml).
SIM_LIB_DEFAULT = "/usr/local/lib/budgetgpu-sim/python"
DEFAULT_SECONDS = 60.0
# Sizes on a real card: large enough to reach its peak, small enough for a 24 GB card with room.
MATMUL_N = 8192
MEMORY_BYTES = 512 << 20
COPY_BYTES = 256 << 20
SAMPLE_INTERVAL_S = 0.2
_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


class CudaBackend:
    """Real GPUs: torch's kernels timed with CUDA events (device time, not the host's)."""

    name = "cuda"

    def __init__(self, torch: Any) -> None:
        if not torch.cuda.is_available():
            raise SystemExit(
                f"gpu_bench_measure: torch {torch.__version__} sees no CUDA device (build "
                f"{torch.version.cuda or 'CPU'}): run it with the job venv's python on a node with a driver"
            )
        self.torch = torch

    def _timed(self, index: int, step: Any, iters: int) -> float:
        torch = self.torch
        stream = torch.cuda.current_stream(index)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        step()
        start.record(stream)
        for _count in range(iters):
            step()
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) / 1000

    def matmul_seconds(self, index: int, dtype: str, n: int, iters: int) -> float:
        torch = self.torch
        with torch.cuda.device(index):
            kind = getattr(torch, _DTYPES[dtype])
            left = torch.randn(n, n, device=f"cuda:{index}", dtype=kind)
            right = torch.randn(n, n, device=f"cuda:{index}", dtype=kind)
            return self._timed(index, lambda: torch.matmul(left, right), iters)

    def memory_seconds(self, index: int, nbytes: int, iters: int) -> float:
        torch = self.torch
        with torch.cuda.device(index):
            src = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{index}")
            dst = torch.empty_like(src)
            return self._timed(index, lambda: dst.copy_(src), iters)

    def copy_seconds(self, index: int, direction: str, nbytes: int, iters: int) -> float:
        torch = self.torch
        with torch.cuda.device(index):
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            device = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{index}")
            src, dst = (host, device) if direction == "h2d" else (device, host)
            return self._timed(index, lambda: dst.copy_(src, non_blocking=True), iters)


def sim_backend(torch: Any, nvml: Any) -> Any:
    """gpu_sim's simulated device (sim_device.py, installed beside its drop-in pynvml)."""
    try:
        import sim_device  # type: ignore[import-not-found]  # pylint: disable=import-outside-toplevel
    except ImportError:
        raise SystemExit(
            "gpu_bench_measure: --backend sim needs gpu_sim's sim_device.py on the path "
            f"({os.environ.get('BUDGETGPU_SIM_LIB', SIM_LIB_DEFAULT)}): this is not a simulated node"
        ) from None
    return sim_device.SimDevice(torch, nvml, pcie.lane_bandwidth_gbps)


class Sampler(threading.Thread):
    """Samples one GPU through nvml_probe.health_gpu every interval until stopped."""

    def __init__(self, nvml_probe: ModuleType, nvml: Any, index: int, interval: float = SAMPLE_INTERVAL_S) -> None:
        super().__init__(daemon=True)
        self.nvml_probe, self.nvml, self.index, self.interval = nvml_probe, nvml, index, interval
        self.samples: list[dict[str, Any]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while True:
            self.samples.append(self.nvml_probe.health_gpu(self.nvml, self.index))
            if self.done.wait(self.interval):
                return

    def stop(self) -> list[dict[str, Any]]:
        self.done.set()
        self.join(5)
        self.samples.append(self.nvml_probe.health_gpu(self.nvml, self.index))
        return self.samples


def summarize_samples(nvml_probe: ModuleType, samples: list[dict[str, Any]], static: dict[str, Any]) -> dict[str, Any]:
    """Return the run's temperature, clock, power and every throttle reason seen in the samples."""

    def numbers(key: str) -> list[float]:
        return [s[key] for s in samples if isinstance(s.get(key), int | float) and not isinstance(s.get(key), bool)]

    reasons: list[str] = []
    for sample in samples:
        mask = sample.get("throttle_reasons")
        if isinstance(mask, int) and not isinstance(mask, bool):
            reasons += [name for name in nvml_probe.decode_throttle_reasons(mask) if name not in reasons]
    temps, clocks, power = numbers("temperature_c"), numbers("sm_clock_mhz"), numbers("power_draw_w")
    return {
        "count": len(samples),
        "temperature_c_max": max(temps) if temps else None,
        "sm_clock_mhz_median": statistics.median(clocks) if clocks else None,
        "sm_clock_mhz_min": min(clocks) if clocks else None,
        "sm_clock_max_mhz": static.get("sm_clock_max_mhz"),
        "power_w_max": max(power) if power else None,
        "power_limit_w": static.get("power_limit_w"),
        "throttle_reasons": reasons,
    }


def _measure(run: Any, deadline: float, target_s: float) -> tuple[float, int] | None:
    """Run run(iters) once to warm up and size it, then for about target_s; None past the deadline."""
    if time.monotonic() >= deadline:
        return None
    once = max(run(1), 1e-6)
    iters = int(max(1, min(50, target_s / once)))
    if time.monotonic() + once * iters >= deadline:
        return once, 1
    return run(iters), iters


def measure_gpu(backend: Any, index: int, dtypes: list[str], seconds: float) -> dict[str, Any]:
    """Return one GPU's figures (TFLOPS, GB/s), measured within `seconds`; timed_out when cut short."""
    start = time.monotonic()
    deadline = start + seconds
    target = max(0.05, seconds / (len(dtypes) + 3) / 3)
    figures: dict[str, Any] = {"matmul_tflops": {}, "memory_gbs": None, "h2d_gbs": None, "d2h_gbs": None}
    timed_out = False
    for dtype in dtypes:
        got = _measure(lambda iters, d=dtype: backend.matmul_seconds(index, d, MATMUL_N, iters), deadline, target)
        if got is None:
            timed_out = True
            break
        figures["matmul_tflops"][dtype] = round(2 * MATMUL_N**3 * got[1] / got[0] / 1e12, 2)
    steps = (
        ("memory_gbs", lambda iters: backend.memory_seconds(index, MEMORY_BYTES, iters), 2 * MEMORY_BYTES),
        ("h2d_gbs", lambda iters: backend.copy_seconds(index, "h2d", COPY_BYTES, iters), COPY_BYTES),
        ("d2h_gbs", lambda iters: backend.copy_seconds(index, "d2h", COPY_BYTES, iters), COPY_BYTES),
    )
    for key, run, moved in steps:
        got = None if timed_out else _measure(run, deadline, target)
        if got is None:
            timed_out = True
            break
        # A device copy reads and writes every byte: memory bandwidth counts both.
        figures[key] = round(moved * got[1] / got[0] / 1e9, 2)
    return {**figures, "seconds": round(time.monotonic() - start, 2), "timed_out": timed_out}


def bench_node(
    backend: Any, nvml: Any, sysfs_root: str, seconds: float, only: list[int] | None = None
) -> dict[str, Any]:
    """Return {host, backend, seconds_per_gpu, gpus} for this node's GPUs (or the indices in only)."""
    facts = nvml_probe.probe_nvml(nvml)
    if not facts["driver"].get("loaded"):
        raise SystemExit(f"gpu_bench_measure: {facts['driver'].get('reason')}")
    links = {gpu["bus_id"]: gpu for gpu in pcie.probe_pcie(sysfs_root)["gpus"]}
    host = socket.gethostname()
    results = []
    # The samplers read through nvml_probe's Reader, within one NVML session for the whole run.
    with nvml_probe.session(nvml):
        for static in facts["gpus"]:
            index = static["index"]
            if only is not None and index not in only:
                continue
            path = links.get(static.get("bus_id"), {})
            effective, capable = path.get("effective") or {}, path.get("capable") or {}
            dtypes = gpu_bench.dtypes_for(static.get("compute_capability"))
            sampler = Sampler(nvml_probe, nvml, index)
            sampler.start()
            try:
                figures = measure_gpu(backend, index, dtypes, seconds)
            finally:
                samples = sampler.stop()
            results.append(
                {
                    "host": host,
                    "index": index,
                    "uuid": static.get("uuid"),
                    "bus_id": static.get("bus_id"),
                    "name": static.get("name"),
                    "device_id": path.get("device_id"),
                    "compute_capability": static.get("compute_capability"),
                    "dtypes": dtypes,
                    **figures,
                    "link": {
                        "gen": effective.get("gen"),
                        "width": effective.get("width"),
                        "bandwidth_gbps": effective.get("bandwidth_gbps"),
                        "capable_gen": capable.get("gen"),
                        "capable_width": capable.get("width"),
                        "limiting_hop": path.get("limiting_hop"),
                    },
                    "samples": summarize_samples(nvml_probe, samples, static),
                    "errors": static.get("errors") or {},
                }
            )
    return {"host": host, "backend": backend.name, "seconds_per_gpu": seconds, "gpus": results}


def measure(
    backend: str = "cuda", sysfs_root: str = "/sys", seconds: float = DEFAULT_SECONDS, gpus: str | None = None
) -> dict[str, Any]:
    """Return bench_node's answer with the named backend ("cuda" or "sim"), for the GPUs in gpus
    ("0,2"; None: all). Imports torch and pynvml: run it in the job venv's python."""
    # torch numbers CUDA devices fastest first unless told otherwise; NVML by PCI bus id.
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if backend == "sim":
        sys.path.insert(0, os.environ.get("BUDGETGPU_SIM_LIB", SIM_LIB_DEFAULT))
    import pynvml  # pylint: disable=import-outside-toplevel
    import torch  # pylint: disable=import-outside-toplevel

    device = sim_backend(torch, pynvml) if backend == "sim" else CudaBackend(torch)
    only = [int(index) for index in gpus.split(",")] if gpus else None
    return bench_node(device, pynvml, sysfs_root, seconds, only)
