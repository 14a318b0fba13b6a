"""One process of tests/unit/test_inference_worker.py's split test, run with accelerate importable
(requirements-split.txt from the wheelhouse on PYTHONPATH, as role inference installs it for a service
of several GPUs per worker): the worker's placement and dtype for simulated GPUs, and the device map
transformers computes from them for the worker's model, as from_pretrained does when the worker loads
it. The model is built from its config on the meta device (no weights); only the GPUs are simulated,
beneath torch.cuda, with the free memory given.

    python inference_split_probe.py WORKER_SCRIPT CONFIG_JSON FREE_BYTES,FREE_BYTES,... [LAYERS]

LAYERS, where given, replaces the model config's number of layers (a deeper model of the same width).

Prints {"placement": the worker's from_pretrained arguments, "device_map": module -> device} as JSON."""

from __future__ import annotations

import importlib.util
import json
import sys
from types import SimpleNamespace

import torch

TOTAL = 24 * 1024**3  # an RTX 3090, as gpu_sim's profiles


def simulate_gpus(free: list[int]) -> None:
    """CUDA GPUs as torch.cuda reports them to accelerate and transformers: a count, each one's free
    and total memory, nothing allocated by this process. accelerate touches each GPU with a tensor
    before it asks: that tensor is made on the CPU."""
    tensor = torch.tensor

    def tensor_on_a_gpu(data, *args, device=None, **kwargs):  # noqa: ANN001, ANN202
        return tensor(data, *args, device="cpu" if isinstance(device, int) else device, **kwargs)

    torch.tensor = tensor_on_a_gpu
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: len(free)
    torch.cuda.mem_get_info = lambda index=None: (free[index], TOTAL)
    torch.cuda.get_device_properties = lambda index=None: SimpleNamespace(total_memory=TOTAL, is_integrated=False)
    torch.cuda.memory_reserved = torch.cuda.memory_allocated = lambda index=None: 0


def load_worker(path: str):  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("inference_worker", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["inference_worker"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main() -> int:
    script, raw, free = sys.argv[1], json.loads(sys.argv[2]), [int(v) for v in sys.argv[3].split(",")]
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.accelerate import _get_device_map, check_and_set_device_map

    worker = load_worker(script)
    config = worker.parse_config(raw)
    model_config = AutoConfig.from_pretrained(config.model_dir, local_files_only=True)
    if len(sys.argv) > 4:
        model_config.num_hidden_layers = int(sys.argv[4])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, dtype=worker._torch_dtype(config, "cuda:0"))
    simulate_gpus(free)
    # What load_engine does on a node of these GPUs, then from_pretrained's own step for a device_map.
    worker.check_device(config, torch.cuda.is_available())
    where = worker.placement(config, torch.cuda.device_count())
    device_map = _get_device_map(model, check_and_set_device_map(where.get("device_map")), None, None)
    print(json.dumps({"placement": where, "device_map": device_map}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
