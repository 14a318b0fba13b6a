"""Stand-in Alertmanager for the molecule scenario "reprovision": on 127.0.0.1:9093, appends the body
of every POST /api/v2/alerts to /tmp/alerts.jsonl, one line each, and answers 200."""

import http.server


class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with open("/tmp/alerts.jsonl", "ab") as stream:
            stream.write(self.path.encode() + b" " + body + b"\n")
        self.send_response(200)
        self.end_headers()


http.server.HTTPServer(("127.0.0.1", 9093), Handler).serve_forever()
