"""One model across nodes with llama.cpp's RPC backend (issue 43, items 6 and 7): tokens/s of one stream and of
8 concurrent streams for a model split over two nodes against the same model on one node, interleaved in one
run, and the restart time of the split service with and without the RPC servers' cache (-c).

    .venv/bin/python tests/benchmarks/llamacpp_rpc.py [--json FILE]            # two node containers (item 6)
    python3 tests/benchmarks/llamacpp_rpc.py --local [--bin DIR] [--json FILE]   # one machine (item 7)

The model: GPT-2's architecture at width 1024, 8 layers, random weights in float32 (about 400 MB) and the tiny
GPT-2's tokenizer, written by tests/fixtures/tiny_gguf.py's writer (once, into --model). Width 1024 so that the
large matrices are over llama.cpp's RPC hash threshold (10 MiB): only those go through the cache.

Containers (the default): two containers of the node image, llamarpc-head and llamarpc-node on network
llamarpc-net (names of this benchmark alone), each with --cpus of CPU, both links shaped to --link-mbit with the
scaling benchmark's tbf (scaling_worker.shape, run in each container). The head runs two llama-servers at once:
"one node" (the model on its own CPU) and "split" (-ngl all over two ggml-rpc-servers, one on the head, one on the
other node: the layers half on each, as a head's own GPU and another node's). Every request is a completion of
--tokens tokens (ignore_eos: every run generates the same count). Then the split service is restarted as its
units restart it (the RPC servers, then llama-server), timed until /health answers and a completion returns,
with and without -c (the cache emptied before its first start, which fills it), alternating.

--local (the device check, scripts under tests/benchmarks/device-check.sh part rpc): no containers; llama-server
alone (every layer on the GPU of a CUDA build, on the CPU of a CPU build) against llama-server --rpc to one
ggml-rpc-server on 127.0.0.1 holding every layer (--device: the RPC device only; on the same GPU). No restarts.

The binaries: --bin, else scripts/build-llama-server's (cached) CPU build. The containers and network are
removed at the end, and before the start if an earlier run left them. On a shared machine absolute figures
move run to run: the rounds alternate the order of the two services, and each round's split/one-node ratio
compares two neighbours.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from scaling import HERE, IMAGE, ROOT, sh, spread

sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
from tiny_gguf import build_tiny_gguf  # noqa: E402

HEAD, NODE = "llamarpc-head", "llamarpc-node"
NETWORK, SUBNET = "llamarpc-net", "10.231.229.0/24"
ADDRESS = {HEAD: "10.231.229.11", NODE: "10.231.229.12"}
RPC_PORT, SPLIT_PORT, ONE_PORT = 50052, 8080, 8081
CACHE_DIR = "/tmp/llamarpc-cache"  # LLAMA_CACHE of every RPC server: -c writes its rpc/ below it
TINY_LM = ROOT / ".cache" / "molecule-inference" / "tiny-lm"
PROMPT = "The cluster serves one model over two nodes, and every node holds half of its layers:"
STREAMS = (1, 8)


def build_model(out: Path, width: int, layers: int) -> Path:
    """GPT-2 of width `width` and `layers` blocks, random weights (std 0.02, layer norms 1 and 0), with the tiny
    GPT-2's tokenizer, as one GGUF at out (kept: a second run reuses it)."""
    import numpy as np
    from safetensors.numpy import save_file

    if out.exists():
        return out
    config = json.loads((TINY_LM / "config.json").read_text())
    config.update(n_embd=width, n_layer=layers, n_head=width // 64, n_positions=1024)
    vocab, rng = config["vocab_size"], np.random.default_rng(43)

    def normal(*shape: int) -> Any:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    state = {"transformer.wte.weight": normal(vocab, width), "transformer.wpe.weight": normal(1024, width),
             "transformer.ln_f.weight": np.ones(width, np.float32),
             "transformer.ln_f.bias": np.zeros(width, np.float32)}  # fmt: skip
    for block in range(layers):
        prefix = f"transformer.h.{block}."
        for norm in ("ln_1", "ln_2"):
            state[f"{prefix}{norm}.weight"] = np.ones(width, np.float32)
            state[f"{prefix}{norm}.bias"] = np.zeros(width, np.float32)
        # Conv1D: (in, out), as Hugging Face's GPT-2 keeps them.
        for name, rows, cols in (("attn.c_attn", width, 3 * width), ("attn.c_proj", width, width),
                                 ("mlp.c_fc", width, 4 * width), ("mlp.c_proj", 4 * width, width)):  # fmt: skip
            state[f"{prefix}{name}.weight"] = normal(rows, cols)
            state[f"{prefix}{name}.bias"] = np.zeros(cols, np.float32)
    with tempfile.TemporaryDirectory() as directory:
        model_dir = Path(directory)
        (model_dir / "config.json").write_text(json.dumps(config))
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (TINY_LM / name).exists():
                shutil.copy(TINY_LM / name, model_dir / name)
        save_file(state, str(model_dir / "model.safetensors"))
        del state
        partial = out.with_suffix(".partial")
        build_tiny_gguf(model_dir, partial)
        partial.rename(out)
    return out


def binaries(bin_dir: Path | None) -> Path:
    """The directory of llama-server and ggml-rpc-server: bin_dir, else scripts/build-llama-server's build."""
    if bin_dir is None:
        built = sh(str(ROOT / "scripts" / "build-llama-server")).stdout.split()
        bin_dir = Path(built[-1]).parent
    for name in ("llama-server", "ggml-rpc-server"):
        if not os.access(bin_dir / name, os.X_OK):
            raise SystemExit(f"no {name} in {bin_dir}")
    return bin_dir


class Process:
    """A server started in a container (docker exec, its pid in a file there) or on this machine."""

    def __init__(self, container: str | None, name: str, argv: list[str], env: dict[str, str], log_dir: Path):
        self.container, self.name = container, name
        if container is None:
            self.log = log_dir / f"{name}.log"
            with open(self.log, "w") as handle:
                self.proc = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, **env})
        else:
            self.log = Path(f"/tmp/{name}.log")  # in the container
            script = f'echo $$ >/tmp/{name}.pid; exec "$@" >{self.log} 2>&1'
            variables = [word for key, value in env.items() for word in ("-e", f"{key}={value}")]
            sh("docker", "exec", "-d", *variables, container, "sh", "-c", script, name, *argv)

    def stop(self) -> None:
        if self.container is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        else:
            sh("docker", "exec", self.container, "sh", "-c",
               f"pid=$(cat /tmp/{self.name}.pid); kill $pid; while kill -0 $pid 2>/dev/null; do sleep 0.1; done",
               check=False)  # fmt: skip

    def alive(self) -> bool:
        if self.container is None:
            return self.proc.poll() is None
        probe = sh("docker", "exec", self.container, "sh", "-c", f"kill -0 $(cat /tmp/{self.name}.pid)", check=False)
        return probe.returncode == 0

    def tail(self) -> str:
        if self.container is None:
            return self.log.read_text()[-3000:]
        return sh("docker", "exec", self.container, "tail", "-c", "3000", str(self.log), check=False).stdout


def post(url: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def complete(base: str, tokens: int) -> dict[str, Any]:
    """One completion of exactly `tokens` tokens: the server's own count and generation rate."""
    answer = post(f"{base}/completion", {"prompt": PROMPT, "n_predict": tokens, "ignore_eos": True,
                                         "cache_prompt": False, "temperature": 0})  # fmt: skip
    if answer["tokens_predicted"] != tokens:
        raise SystemExit(f"{base}: {answer['tokens_predicted']} tokens, expected {tokens}")
    return answer


def wait_ready(base: str, server: Process, timeout: float) -> None:
    """Until /health answers 200 (llama-server answers 503 while it loads)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.alive():
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    state = "not ready" if server.alive() else "exited"
    raise SystemExit(f"{base} {state} after {time.monotonic() - deadline + timeout:.0f} s:\n{server.tail()}")


def measure(base: str, streams: int, tokens: int) -> dict[str, Any]:
    """`streams` completions at once: their tokens over the wall time, and each one's own rate."""
    started = time.monotonic()
    with ThreadPoolExecutor(streams) as pool:
        answers = list(pool.map(lambda _stream: complete(base, tokens), range(streams)))
    wall = time.monotonic() - started
    rates = [answer["timings"]["predicted_per_second"] for answer in answers]
    return {"streams": streams, "tokens_per_s": streams * tokens / wall, "wall_s": wall,
            "stream_tokens_per_s": statistics.median(rates)}  # fmt: skip


class Bench:
    def __init__(self, args: argparse.Namespace, bin_dir: Path, model: Path, log_dir: Path):
        self.args, self.log_dir = args, log_dir
        self.local = args.local
        self.bin = Path("/opt/llama") if not self.local else bin_dir
        self.model = Path("/opt/model") / model.name if not self.local else model
        self.head_host = "127.0.0.1" if self.local else ADDRESS[HEAD]

    def spawn(self, container: str, name: str, argv: list[str], env: dict[str, str] | None = None) -> Process:
        return Process(None if self.local else container, name, argv, env or {}, self.log_dir)

    def rpc_servers(self, cache: bool) -> tuple[list[Process], list[str]]:
        """The RPC servers (containers: on the head at 127.0.0.1 and on the other node at its address; local: one
        at 127.0.0.1) and their endpoints in llama-server's --rpc order."""
        where = [(HEAD, "127.0.0.1")] if self.local else [(HEAD, "127.0.0.1"), (NODE, ADDRESS[NODE])]
        servers, endpoints = [], []
        for container, host in where:
            argv = [str(self.bin / "ggml-rpc-server"), "-H", host, "-p", str(RPC_PORT), "-t", str(self.args.threads)]
            servers.append(self.spawn(container, f"rpc-{container}", argv + (["-c"] if cache else []),
                                      {"LLAMA_CACHE": CACHE_DIR}))  # fmt: skip
            endpoints.append(f"{host}:{RPC_PORT}")
        time.sleep(1)  # listening: llama-server aborts on an RPC server that does not answer
        return servers, endpoints

    def llama_server(self, name: str, port: int, endpoints: list[str]) -> Process:
        slots = max(STREAMS)
        argv = [str(self.bin / "llama-server"), "-m", str(self.model), "--host", "0.0.0.0", "--port", str(port),
                "-np", str(slots), "-c", str(slots * 256), "-t", str(self.args.threads), "-ngl", "all",
                "--no-webui"]  # fmt: skip
        if endpoints:
            argv += ["--rpc", ",".join(endpoints)]
            if self.local:  # every layer on the RPC server, none on this llama-server's own GPU
                argv += ["--device", "RPC0"]
            else:
                argv += ["--tensor-split", ",".join("1" for _endpoint in endpoints)]
        return self.spawn(HEAD, name, argv)

    def base(self, port: int) -> str:
        return f"http://{self.head_host}:{port}"

    def throughput(self) -> list[dict[str, Any]]:
        """Both services up at once; each round measures 1 and 8 streams on each, the order alternating."""
        rows: list[dict[str, Any]] = []
        rpc, endpoints = self.rpc_servers(cache=False)
        services = {"one node": self.llama_server("one", ONE_PORT, []),
                    "split": self.llama_server("split", SPLIT_PORT, endpoints)}  # fmt: skip
        ports = {"one node": ONE_PORT, "split": SPLIT_PORT}
        try:
            for service, server in services.items():
                wait_ready(self.base(ports[service]), server, 600)
                complete(self.base(ports[service]), self.args.tokens)  # warm-up
                print(f"{service}: ready", file=sys.stderr)
            for round_ in range(self.args.rounds):
                order = list(services) if round_ % 2 == 0 else list(services)[::-1]
                for service in order:
                    for streams in STREAMS:
                        found = measure(self.base(ports[service]), streams, self.args.tokens)
                        row = {"round": round_, "service": service, **found}
                        print(json.dumps(row), file=sys.stderr)
                        rows.append(row)
        finally:
            for process in (*services.values(), *rpc):
                process.stop()
        return rows

    def restarts(self) -> list[dict[str, Any]]:
        """The split service restarted as its units restart it: RPC servers, then llama-server; the time to
        /health and one completion. Without the cache, then with it from empty (it fills), then alternating."""
        rows = []
        for container in (HEAD, NODE):
            sh("docker", "exec", container, "rm", "-rf", CACHE_DIR)
        for index, cache in enumerate([False, True] + [False, True] * self.args.restarts):
            started = time.monotonic()
            rpc, endpoints = self.rpc_servers(cache)
            server = self.llama_server("split", SPLIT_PORT, endpoints)
            try:
                wait_ready(self.base(SPLIT_PORT), server, 600)
                ready = time.monotonic() - started
                complete(self.base(SPLIT_PORT), 8)
                row = {"cache": cache, "first": index == 1, "ready_s": ready, "answered_s": time.monotonic() - started}
            finally:
                for process in (server, *rpc):
                    process.stop()
            cached = sh("docker", "exec", NODE, "du", "-sm", CACHE_DIR, check=False).stdout.split()
            row["node_cache_mb"] = int(cached[0]) if cached else 0
            print(json.dumps(row), file=sys.stderr)
            rows.append(row)
        return rows


def cleanup() -> None:
    for name in (HEAD, NODE):
        sh("docker", "rm", "-f", name, check=False)
    sh("docker", "network", "rm", NETWORK, check=False)


def libgomp(binary: Path) -> Path:
    """The host's libgomp that the CPU build links (the node image has none)."""
    for line in sh("ldd", str(binary)).stdout.splitlines():
        if "libgomp" in line and "=>" in line:
            return Path(line.split("=>")[1].split()[0]).resolve()
    raise SystemExit(f"{binary} links no libgomp (ldd)")


def start(args: argparse.Namespace, bin_dir: Path, model: Path) -> None:
    """The two containers, each with args.cpus of CPU, the binaries, the host's libgomp and the model read-only,
    both links shaped to args.link_mbit by scaling_worker.shape."""
    cleanup()
    sh("docker", "network", "create", "--subnet", SUBNET, NETWORK)
    gomp = libgomp(bin_dir / "llama-server")
    for name in (HEAD, NODE):
        mounts = ["-v", f"{bin_dir}:/opt/llama:ro", "-v", f"{gomp}:/opt/lib/libgomp.so.1:ro",
                  "-v", f"{HERE}:/opt/bench:ro"]  # fmt: skip
        if name == HEAD:  # the other node gets the weights from the head, over the link
            mounts += ["-v", f"{model.parent}:/opt/model:ro"]
        sh("docker", "run", "-d", "--name", name, "--hostname", name, "--network", NETWORK, "--ip", ADDRESS[name],
           f"--cpus={args.cpus}", "--cap-add", "NET_ADMIN", "-e", "LD_LIBRARY_PATH=/opt/lib", *mounts,
           "--entrypoint", "sleep", IMAGE, "infinity")  # fmt: skip
        if args.link_mbit:
            shape = f"from scaling_worker import shape; shape({args.link_mbit * 1e6})"
            sh("docker", "exec", "-e", "PYTHONPATH=/opt/bench", name, "python3", "-c", shape)


def table(result: dict[str, Any]) -> str:
    """Per service and streams: tokens/s in all and per stream, median (min-max) over rounds; the split/one-node
    ratio of each round; then the restarts."""
    rows = result["throughput"]
    lines = ["| service | streams | tokens/s in all | tokens/s a stream | split / one node (tokens/s in all) |",
             "| --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for streams in STREAMS:
        by = {
            s: {r["round"]: r for r in rows if (r["service"], r["streams"]) == (s, streams)}
            for s in ("one node", "split")
        }
        one = by["one node"]
        ratios = [r["tokens_per_s"] / one[k]["tokens_per_s"] for k, r in by["split"].items() if k in one]
        for service, found in by.items():
            lines.append(
                f"| {service} | {streams} | {spread([r['tokens_per_s'] for r in found.values()])} | "
                f"{spread([r['stream_tokens_per_s'] for r in found.values()])} | "
                f"{spread(ratios) if service == 'split' else ''} |"
            )
    restarts = result.get("restarts") or []
    if restarts:
        lines += ["", "| restart of the split service | ready (/health) s | answered s | node's cache MB | starts |",
                  "| --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
        for label, pick in (("without cache", lambda r: not r["cache"]),
                            ("cache empty (fills it)", lambda r: r["first"]),
                            ("with cache", lambda r: r["cache"] and not r["first"])):  # fmt: skip
            found = [r for r in restarts if pick(r)]
            cached = max(r["node_cache_mb"] for r in found) if found[0]["cache"] else "-"
            lines.append(f"| {label} | {spread([r['ready_s'] for r in found], 1)} | "
                         f"{spread([r['answered_s'] for r in found], 1)} | {cached} | {len(found)} |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local", action="store_true", help="one machine, one RPC server on 127.0.0.1 (item 7)")
    parser.add_argument("--bin", type=Path, help="llama-server's and ggml-rpc-server's directory")
    parser.add_argument("--model", type=Path, default=Path("/tmp/budgetgpu-llamarpc/gpt2-1024x8-f32.gguf"))
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32, help="tokens each completion generates")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--restarts", type=int, default=2, help="starts with and without cache after the first two")
    parser.add_argument("--cpus", type=float, default=1.0, help="CPU quota of each container")
    parser.add_argument("--threads", type=int, default=1, help="-t of every llama-server and ggml-rpc-server")
    parser.add_argument("--link-mbit", type=float, default=250, help="tbf rate of each container's link (0: none)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--table", type=Path, help="print the table of an earlier --json file and exit")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    started = time.monotonic()
    bin_dir = binaries(args.bin)
    args.model.parent.mkdir(parents=True, exist_ok=True)
    model = build_model(args.model, args.width, args.layers)
    print(f"model {model} ({model.stat().st_size / 1e6:.0f} MB), binaries {bin_dir}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as log_dir:
        bench = Bench(args, bin_dir, model, Path(log_dir))
        result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
        if args.local:
            result["throughput"] = bench.throughput()
        else:
            try:
                start(args, bin_dir, model)
                result["throughput"] = bench.throughput()
                result["restarts"] = bench.restarts()
            finally:
                cleanup()
    result["seconds"] = time.monotonic() - started
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(f"{time.monotonic() - started:.0f} s")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
