#!/usr/bin/env python3
"""A webhook receiver for the monitoring scenario (not shipped): every POST body Alertmanager sends, one JSON
line each, appended to the file named on the command line. Runs on monitoring-h200 as a transient unit."""

from __future__ import annotations

import http.server
import json
import sys


class Receiver(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with open(sys.argv[2], "a", encoding="utf-8") as out:
            out.write(json.dumps(json.loads(body)) + "\n")
        self.send_response(200)
        self.end_headers()


if __name__ == "__main__":
    http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Receiver).serve_forever()
