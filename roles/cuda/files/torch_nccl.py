"""Print, as one JSON line, the torch version, its CUDA and the NCCL it carries (null when absent)."""

import json

report = {"torch": None, "cuda": None, "nccl": None, "error": None}
try:
    import torch

    report["torch"] = torch.__version__
    report["cuda"] = torch.version.cuda
    try:
        version = torch.cuda.nccl.version()
        report["nccl"] = list(version) if isinstance(version, tuple) else version
    except Exception as exc:  # CPU builds have no NCCL
        report["error"] = f"torch carries no NCCL: {exc}"
except Exception as exc:
    report["error"] = f"torch is not importable: {exc}"
print(json.dumps(report))
