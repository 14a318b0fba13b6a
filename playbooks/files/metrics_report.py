#!/usr/bin/env python3
"""Chart the cluster's metrics without Grafana (playbooks/report.yml): every panel of the shipped Grafana
dashboard (roles/prometheus/files/grafana-dashboard.json, the one place for each query), asked of
Prometheus' HTTP API over a time range (query_range), drawn as a PNG per panel and written with a table
of each series (last, min, max) into one static HTML page, the PNGs embedded: it opens in any browser,
from the disk, without a network. Runs on the control node (matplotlib for the charts; without it the
page holds the tables only and says so).

Usage: metrics_report.py --url http://HOST:9090 --dashboard DASHBOARD.json --out DIR
                         [--hours 24 | --start TIME [--end TIME]]
TIME: Unix seconds or ISO 8601 (2026-12-01T06:00:00Z; without a zone: the control node's local time).
Exit 0 with DIR/index.html written (a line per panel on stdout), 1 when Prometheus does not answer (or
something else answers at its URL), 2 on bad arguments; the reason on stderr, without a traceback.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# About this many points per series: enough for a day at a glance, far under Prometheus' 11,000 limit.
POINTS = 300
# The window of rate()/increase() ($__rate_interval): Grafana's is at least four scrapes; the report does
# not know the scrape interval, and 2 minutes holds four of the default 30 s.
MIN_RATE_WINDOW_S = 120
TIMEOUT_S = 30
UNITS = {"celsius": "°C", "watt": "W", "percent": "%", "rotmhz": "MHz", "s": "s", "reqps": "req/s"}


class Unreachable(Exception):
    """Prometheus did not answer at the URL, or what answered is not Prometheus' API."""


class BadArguments(Exception):
    """A time that is not Unix seconds or ISO 8601, or a range that ends before it starts."""


@dataclass
class Series:
    name: str
    labels: dict[str, str]
    times: list[float]
    values: list[float]
    # The panel's second and later queries are references (the limit, the target, the width at boot): dashed.
    reference: bool = False


@dataclass
class Panel:
    id: int
    title: str
    description: str
    unit: str
    targets: list[dict[str, str]]
    series: list[Series] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    png: str = ""


def _substitutions(dashboard: dict[str, Any], step: float) -> dict[str, str]:
    """Return {"$name": value}: every variable of the dashboard at its "All" value, and Grafana's intervals."""
    window = f"{int(max(2 * step, MIN_RATE_WINDOW_S))}s"
    subs = {"$__rate_interval": window, "$__interval": f"{int(math.ceil(step))}s", "$__range": window}
    for variable in (dashboard.get("templating") or {}).get("list") or []:
        if variable.get("type") != "datasource":
            subs["$" + variable["name"]] = str(variable.get("allValue") or ".*")
    return subs


def expand(expr: str, subs: dict[str, str]) -> str:
    """Return expr with ${name} and $name replaced (longest names first: $node before $no)."""
    for name in sorted(subs, key=len, reverse=True):
        expr = expr.replace("${" + name[1:] + "}", subs[name]).replace(name, subs[name])
    return expr


def load_panels(dashboard: dict[str, Any], step: float) -> list[Panel]:
    """Return the dashboard's graph panels in order (rows left out, a collapsed row's panels kept), each
    target's expr expanded for Prometheus."""
    subs, panels = _substitutions(dashboard, step), []
    flat = []
    for panel in dashboard.get("panels") or []:
        flat += [panel] if panel.get("type") != "row" else (panel.get("panels") or [])
    for panel in flat:
        targets = [
            {"expr": expand(t["expr"], subs), "legend": t.get("legendFormat") or ""}
            for t in panel.get("targets") or []
            if t.get("expr")
        ]
        unit = ((panel.get("fieldConfig") or {}).get("defaults") or {}).get("unit") or ""
        panels.append(Panel(panel["id"], panel["title"], panel.get("description") or "", unit, targets))
    return panels


def parse_time(text: str) -> float:
    """Return Unix seconds of text: a number, or ISO 8601 (a naive time is the control node's local time)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise BadArguments(f"{text!r} is neither Unix seconds nor an ISO 8601 time (2026-12-01T06:00:00Z)") from None
    return (moment if moment.tzinfo else moment.astimezone()).timestamp()


def time_range(hours: float, start: str | None, end: str | None, now: float) -> tuple[float, float, float]:
    """Return (start, end, step) in seconds: start..end when given (end defaults to now), else the last
    hours; step for about POINTS points, at least a second."""
    stop = parse_time(end) if end else now
    begin = parse_time(start) if start else stop - hours * 3600
    if begin >= stop:
        raise BadArguments(f"the range starts ({begin:.0f}) at or after its end ({stop:.0f}): start must be earlier")
    return begin, stop, max(1.0, math.ceil((stop - begin) / POINTS))


def _answer_text(answer: Any) -> tuple[str, str]:
    body = answer.read(65536).decode("utf-8", "replace")
    return body, answer.headers.get("Content-Type", "")


def query_range(url: str, expr: str, span: tuple[float, float, float]) -> tuple[list[dict[str, Any]], str]:
    """Return (matrix, error) of expr over span from Prometheus at url; error is Prometheus' own refusal
    of the query (the panel shows it). Raise Unreachable when nothing (or not Prometheus) answers."""
    params = urllib.parse.urlencode({"query": expr, "start": span[0], "end": span[1], "step": span[2]})
    full = f"{url.rstrip('/')}/api/v1/query_range?{params}"
    try:
        with urllib.request.urlopen(full, timeout=TIMEOUT_S) as answer:  # noqa: S310 (the inventory's URL)
            body, kind = _answer_text(answer)
            code = answer.status
    except urllib.error.HTTPError as exc:
        body, kind = _answer_text(exc)
        code = exc.code
    except OSError as exc:  # URLError, a timeout, a reset: nothing answered
        reason = getattr(exc, "reason", exc)
        raise Unreachable(f"Prometheus at {url} did not answer: {reason}") from None
    try:
        data = json.loads(body)
        status = data["status"]
    except (ValueError, KeyError, TypeError):
        found = " ".join(body.split())[:120]
        raise Unreachable(
            f"{url} is not Prometheus' HTTP API: /api/v1/query_range answered HTTP {code}"
            f" ({kind or 'no content type'}): {found!r}"
        ) from None
    if status != "success":
        return [], f"{data.get('errorType', 'error')}: {data.get('error', body[:200])}"
    return data.get("data", {}).get("result") or [], ""


def legend(fmt: str, labels: dict[str, str]) -> str:
    """Return Grafana's legendFormat filled in ({{label}}; a missing label is empty), else the labels."""
    if not fmt:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__") + "}"
    return " ".join(
        re.sub(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).split()
    )


def _series(result: dict[str, Any], fmt: str, reference: bool) -> Series:
    times, values = [], []
    for moment, text in result.get("values") or []:
        times.append(float(moment))
        values.append(float(text))
    labels = {str(k): str(v) for k, v in (result.get("metric") or {}).items()}
    return Series(legend(fmt, labels), labels, times, values, reference)


def collect(url: str, panels: list[Panel], span: tuple[float, float, float]) -> None:
    """Fill each panel's series (and errors) from Prometheus; Unreachable goes up to the caller."""
    for panel in panels:
        for number, target in enumerate(panel.targets):
            results, error = query_range(url, target["expr"], span)
            if error:
                panel.errors.append(f"{target['expr']}: {error}")
            panel.series += [_series(result, target["legend"], number > 0) for result in results]


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(plt: Any, panel: Panel, path: Path) -> None:
    """Draw the panel's series against UTC (as the page's header), a legend beside when they are few enough
    to read (the page's table names them all)."""
    fig, ax = plt.subplots(figsize=(10, 4), dpi=90)
    for series in panel.series:
        moments = [datetime.fromtimestamp(t, UTC) for t in series.times]
        style = "--" if series.reference else "-"
        ax.plot(moments, series.values, linestyle=style, linewidth=1.2, label=series.name)
    ax.set_title(panel.title)
    ax.set_ylabel(UNITS.get(panel.unit, ""))
    ax.set_xlabel("UTC")
    ax.grid(True, alpha=0.3)
    fig.autofmt_xdate()
    if len(panel.series) <= 24:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def slug(panel: Panel) -> str:
    return f"panel-{panel.id}-" + re.sub(r"[^a-z0-9]+", "-", panel.title.lower()).strip("-")


def _figure(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    text = f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return f"{text} {UNITS.get(unit, '')}".strip()


def _stats(series: Series) -> tuple[float | None, float | None, float | None]:
    finite = [v for v in series.values if math.isfinite(v)]
    if not finite:
        return None, None, None
    return finite[-1], min(finite), max(finite)


def _series_rows(panel: Panel) -> list[str]:
    rows = []
    for series in panel.series:
        last, low, high = _stats(series)
        labels = ", ".join(f"{k}={v}" for k, v in sorted(series.labels.items()) if k != "__name__")
        cells = [f"{html.escape(series.name)}<br><small>{html.escape(labels)}</small>"]
        cells += [_figure(value, panel.unit) for value in (last, low, high)]
        rows.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
    return rows


def _panel_html(panel: Panel, out: Path) -> str:
    parts = [f'<section id="{slug(panel)}"><h2>{html.escape(panel.title)}</h2>']
    parts.append(f"<p>{html.escape(panel.description)}</p>")
    parts += [f'<p class="error">query failed: {html.escape(error)}</p>' for error in panel.errors]
    if not panel.series:
        parts.append('<p class="nodata">no data in this time range</p>')
    else:
        if panel.png:
            data = base64.b64encode((out / panel.png).read_bytes()).decode()
            parts.append(f'<img alt="{html.escape(panel.title)}" src="data:image/png;base64,{data}">')
        parts.append("<table><tr><th>series</th><th>last</th><th>min</th><th>max</th></tr>")
        parts += _series_rows(panel) + ["</table>"]
    queries = "".join(f"<li><code>{html.escape(t['expr'])}</code></li>" for t in panel.targets)
    parts.append(f"<details><summary>queries</summary><ul>{queries}</ul></details></section>")
    return "\n".join(parts)


STYLE = (
    "body{font-family:sans-serif;max-width:1100px;margin:auto;padding:1em}"
    "table{border-collapse:collapse;font-size:90%}td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}"
    "small{color:#666}.nodata{color:#888;font-style:italic}.error{color:#b00}img{max-width:100%}"
)


def write_page(panels: list[Panel], out: Path, url: str, span: tuple[float, float, float], note: str) -> Path:
    """Write out/index.html: a header (Prometheus, the range, what has no data), then every panel."""
    when = [datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC") for t in span[:2]]
    empty = [p.title for p in panels if not p.series]
    head = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><title>budgetgpu cluster report</title>',
        f"<style>{STYLE}</style></head><body><h1>budgetgpu cluster report</h1>",
        f"<p>Prometheus {html.escape(url)}, {when[0]} to {when[1]}, a point every {span[2]:.0f} s; "
        f"written {datetime.now(UTC).strftime('%Y-%m-%d %H:%M:%S UTC')}.</p>",
    ]
    if note:
        head.append(f'<p class="error">{html.escape(note)}</p>')
    if empty:
        head.append(f'<p class="nodata">no data: {html.escape(", ".join(empty))}</p>')
    body = [_panel_html(panel, out) for panel in panels]
    page = out / "index.html"
    page.write_text("\n".join(head + body + ["</body></html>"]) + "\n", encoding="utf-8")
    return page


def draw(panels: list[Panel], out: Path) -> str:
    """Write a PNG per panel with data (panel.png set); return why there are none, or ""."""
    plt = _pyplot()
    if plt is None:
        return "no charts: matplotlib is not installed on the control node (pip install matplotlib); tables only"
    for panel in panels:
        if panel.series:
            panel.png = slug(panel) + ".png"
            plot(plt, panel, out / panel.png)
    return ""


def report(url: str, dashboard: dict[str, Any], out: Path, span: tuple[float, float, float]) -> list[Panel]:
    """Ask Prometheus for every panel, write the PNGs and the page, and return the panels."""
    panels = load_panels(dashboard, span[2])
    collect(url, panels, span)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("panel-*.png"):
        old.unlink()  # a panel without data this time leaves no chart of an earlier report
    note = draw(panels, out)
    write_page(panels, out, url, span, note)
    if note:
        print(note)
    return panels


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--url", required=True, help="Prometheus, http://HOST:9090")
    parser.add_argument("--dashboard", required=True, help="the Grafana dashboard JSON whose panels to chart")
    parser.add_argument("--out", required=True, help="the directory for index.html and the PNGs")
    parser.add_argument("--hours", type=float, default=24.0, help="the last hours (default 24)")
    parser.add_argument("--start", help="the range's start (Unix seconds or ISO 8601); overrides --hours")
    parser.add_argument("--end", help="the range's end (default now)")
    return parser.parse_args(argv)


def _dashboard(path: str) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BadArguments(f"cannot read the dashboard {path}: {exc}") from None


def main(argv: list[str]) -> int:
    args = _arguments(argv)
    try:
        span = time_range(args.hours, args.start, args.end, time.time())
        dashboard = _dashboard(args.dashboard)
        panels = report(args.url, dashboard, Path(args.out).expanduser(), span)
    except Unreachable as exc:
        print(f"report: {exc}", file=sys.stderr)
        return 1
    except BadArguments as exc:
        print(f"report: {exc}", file=sys.stderr)
        return 2
    for panel in panels:
        state = f"{len(panel.series)} series" if panel.series else "no data"
        print(f"{panel.title}: {state}" + "".join(f"; query failed: {e}" for e in panel.errors))
    print(f"report: {Path(args.out).expanduser() / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
