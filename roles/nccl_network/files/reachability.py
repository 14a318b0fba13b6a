#!/usr/bin/env python3
"""Prove that this node reaches its peers, and let them reach it: TCP listeners plus TCP connects.

Runs on every node at once (Ansible starts it asynchronously everywhere, then waits). Each node
listens on its NCCL address (and the master on the rendezvous ports), connects to every target
until it answers or the deadline passes, and prints one JSON object: what it listened on, what it
reached, what it could not, and why. Standard library only: it runs before any venv exists.
"""

from __future__ import annotations

import argparse
import errno
import json
import socket
import sys
import threading
import time
from typing import Any


def split_endpoint(text: str) -> tuple[str, int]:
    """Return (address, port) from ADDR:PORT or [IPv6]:PORT."""
    address, _unused, port = text.rpartition(":")
    return address.strip("[]"), int(port)


class Listener(threading.Thread):
    """Accept connections on one address and port until told to stop; count them."""

    def __init__(self, address: str, port: int, expect: int) -> None:
        super().__init__(daemon=True)
        self.address, self.port, self.expect = address, port, expect
        self.accepted = 0
        self.state = "listening"
        self.sock: socket.socket | None = None
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, port))
            sock.listen(64)
            sock.settimeout(0.2)
            self.sock = sock
        except OSError as exc:
            # A running job's c10d store already listens there: connecting to it still proves the path.
            self.state = "in use" if exc.errno == errno.EADDRINUSE else f"error: {exc.strerror or exc}"

    @property
    def satisfied(self) -> bool:
        return self.sock is None or self.accepted >= self.expect

    def run(self) -> None:
        while self.sock is not None:
            try:
                conn, _unused = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        if self.sock is not None:
            sock, self.sock = self.sock, None
            sock.close()


def connect(address: str, port: int, deadline: float) -> dict[str, Any]:
    """Connect until the peer answers or the deadline passes; return {ok, error, elapsed_ms, tries}."""
    start = time.monotonic()
    tries, error = 0, "not tried"

    def outcome(ok: bool, error: str | None) -> dict[str, Any]:
        return {"ok": ok, "error": error, "elapsed_ms": round((time.monotonic() - start) * 1000), "tries": tries}

    while True:
        tries += 1
        try:
            with socket.create_connection((address, port), timeout=max(0.2, min(2.0, deadline - time.monotonic()))):
                return outcome(True, None)
        except TimeoutError:
            error = "timed out (a firewall dropping packets, or no route)"
        except ConnectionRefusedError:
            error = "connection refused (nothing listens there yet, or a firewall rejects)"
        except OSError as exc:
            error = exc.strerror or str(exc)
        if time.monotonic() + 0.2 >= deadline:
            return outcome(False, error)
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", action="append", default=[], metavar="ADDR:PORT:EXPECT")
    parser.add_argument("--connect", action="append", default=[], metavar="NAME=ADDR:PORT")
    parser.add_argument("--timeout", type=float, default=15.0)
    args = parser.parse_args(argv)

    deadline = time.monotonic() + args.timeout
    listeners = []
    for spec in args.listen:
        endpoint, _unused, expect = spec.rpartition(":")
        listener = Listener(*split_endpoint(endpoint), int(expect))
        listener.start()
        listeners.append(listener)

    results = []
    for spec in args.connect:
        name, _unused, endpoint = spec.partition("=")
        address, port = split_endpoint(endpoint)
        results.append({"name": name, "address": address, "port": port, **connect(address, port, deadline)})

    # Stay up until every peer has connected (or the deadline): they probe us as we probed them.
    while time.monotonic() < deadline and not all(listener.satisfied for listener in listeners):
        time.sleep(0.1)
    for listener in listeners:
        listener.close()
    report = {
        "listening": [
            {"address": x.address, "port": x.port, "state": x.state, "accepted": x.accepted, "expected": x.expect}
            for x in listeners
        ],
        "results": results,
        "ok": all(result["ok"] for result in results),
    }
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
