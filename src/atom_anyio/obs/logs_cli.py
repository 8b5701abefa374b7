"""``atom-anyio logs``: summarize or plot a JSON log written by ``serve``.

The file is streamed line by line (lines that are not JSON objects are
skipped). Memory is bounded by what the answers need: 8 bytes per finished
request and measure (``array('d')``, for exact percentiles), one aggregate per
time window and a heap of the slowest requests."""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from array import array
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

# request.finished fields whose distribution is reported (over requests that ended ok)
MEASURES = ("ttft_s", "e2e_s", "queue_time_s", "prepare_s", "prompt_tokens", "cached_tokens", "generated_tokens")
QUANTILES = (0.5, 0.9, 0.99)


@dataclass
class Window:
    num_requests: int = 0
    num_errors: int = 0
    num_generated_tokens: int = 0
    ttft_s: array = field(default_factory=lambda: array("d"))


class LogSummary:
    """Folds a log's events in one at a time; ``result()`` is a plain dict."""

    def __init__(self, window_s: float = 60.0, num_slowest: int = 10):
        self.window_s = window_s
        self.num_slowest = num_slowest
        self.num_lines = 0
        self.num_skipped = 0
        self.samples = {name: array("d") for name in MEASURES}
        self.outcomes: Counter[str] = Counter()
        self.endpoints: Counter[str] = Counter()
        self.finish_reasons: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.warnings: Counter[str] = Counter()
        self.windows: dict[int, Window] = {}
        self.slowest: list[tuple[float, int, dict]] = []  # min-heap on e2e
        self.first_t: float | None = None  # the first finished request: time 0 of the windows
        self.end_t: float | None = None  # the latest line of any kind: the log ran until then

    def add_line(self, line: str) -> None:
        self.num_lines += 1
        try:
            event = json.loads(line)
        except ValueError:
            event = None
        if not isinstance(event, dict):
            self.num_skipped += 1
            return
        name = event.get("event")
        if (t := parse_time(event.get("timestamp"))) is not None:
            self.end_t = t if self.end_t is None else max(self.end_t, t)
        if name == "request.finished":  # every request has one, refused ones too
            self.add_request(event)
        elif name == "http.access":
            pass  # the same request as its request.finished line
        elif event.get("level") in ("error", "critical"):
            self.errors[f"event {name}"] += 1
        elif event.get("level") == "warning":
            self.warnings[str(name)] += 1

    def add_request(self, event: dict[str, Any]) -> None:
        t = parse_time(event.get("timestamp"))
        if t is None:
            self.num_skipped += 1
            return
        if self.first_t is None:
            self.first_t = t
        outcome = event.get("outcome", "?")
        is_ok = outcome == "ok"
        self.outcomes[outcome] += 1
        self.endpoints[event.get("endpoint", "?")] += 1
        self.finish_reasons[event.get("finish_reason") or outcome] += 1  # nothing generated: say why
        if not is_ok:
            self.errors[f"request {event.get('endpoint')} {outcome} {event.get('status')}"] += 1
        else:
            for name, values in self.samples.items():
                if (value := event.get(name)) is not None:
                    values.append(value)
        w = self.windows.setdefault(int((t - self.first_t) // self.window_s), Window())
        w.num_requests += 1
        w.num_errors += not is_ok
        w.num_generated_tokens += event.get("generated_tokens") or 0
        if is_ok and (ttft := event.get("ttft_s")) is not None:
            w.ttft_s.append(ttft)
        if (e2e := event.get("e2e_s")) is not None and self.num_slowest:
            entry = (e2e, self.outcomes.total(), event)
            if len(self.slowest) < self.num_slowest:
                heapq.heappush(self.slowest, entry)
            elif e2e > self.slowest[0][0]:
                heapq.heapreplace(self.slowest, entry)

    def result(self) -> dict[str, Any]:
        span = max(0.0, self.end_t - self.first_t) if self.first_t is not None else 0.0
        num_requests = self.outcomes.total()
        num_generated = sum(w.num_generated_tokens for w in self.windows.values())
        return {
            "num_lines": self.num_lines,
            "num_skipped": self.num_skipped,
            "num_requests": num_requests,
            "span_s": span,
            "requests_per_s": num_requests / span if span else None,
            "generated_tok_per_s": num_generated / span if span else None,
            "outcomes": dict(self.outcomes),
            "endpoints": dict(self.endpoints),
            "finish_reasons": dict(self.finish_reasons),
            "errors": dict(self.errors.most_common()),
            "warnings": dict(self.warnings.most_common()),
            "percentiles": {name: distribution(values) for name, values in self.samples.items() if values},
            "window_s": self.window_s,
            "windows": [self._window_row(i, span) for i in sorted(self.windows)],
            "slowest": [_slow_row(e) for _, _, e in sorted(self.slowest, key=lambda x: x[0], reverse=True)],
        }

    def _window_row(self, i: int, span: float) -> dict[str, Any]:
        w = self.windows[i]
        start = i * self.window_s
        duration = max(0.0, min(self.window_s, span - start))  # the last one ends where the log does
        ttft = distribution(w.ttft_s)
        return {
            "start_s": start,
            "duration_s": duration,
            "requests": w.num_requests,
            "errors": w.num_errors,
            "requests_per_s": w.num_requests / duration if duration else None,
            "generated_tok_per_s": w.num_generated_tokens / duration if duration else None,
            "ttft_p50_s": ttft.get("p50"),
            "ttft_p90_s": ttft.get("p90"),
            "ttft_p99_s": ttft.get("p99"),
        }


def parse_time(value: Any) -> float | None:
    try:
        return datetime.fromisoformat(value).timestamp()
    except (TypeError, ValueError):
        return None


def distribution(values: array) -> dict[str, float]:
    """count, mean, max and exact percentiles (linear interpolation between ranks)."""
    if not values:
        return {}
    import numpy as np

    data = np.frombuffer(values, dtype=np.float64)
    qs = np.quantile(data, QUANTILES)
    out = {"count": int(data.size), "mean": float(data.mean()), "max": float(data.max())}
    out.update({f"p{round(q * 100)}": float(v) for q, v in zip(QUANTILES, qs, strict=True)})
    return out


def _slow_row(event: dict[str, Any]) -> dict[str, Any]:
    keys = ("request_id", "timestamp", "endpoint", "outcome", "status", "e2e_s", "ttft_s", "queue_time_s")
    return {k: event.get(k) for k in (*keys, "prompt_tokens", "generated_tokens")}


def summarize(path: str | Path, window_s: float = 60.0, num_slowest: int = 10) -> dict[str, Any]:
    summary = LogSummary(window_s, num_slowest)
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            summary.add_line(line)
    return summary.result()


# rendering


def print_summary(s: dict[str, Any], out: TextIO | None = None) -> None:
    def p(text: str = "") -> None:
        print(text, file=out or sys.stdout)

    rate = f"{s['requests_per_s']:.2f} req/s, {s['generated_tok_per_s']:.1f} generated tok/s" if s["span_s"] else "-"
    p(f"{s['num_lines']} lines ({s['num_skipped']} skipped), {s['num_requests']} requests")
    p(f"over {s['span_s']:.1f} s: {rate}")
    for title in ("outcomes", "endpoints", "finish_reasons"):
        p(f"{title}: " + "  ".join(f"{k} {v}" for k, v in s[title].items()))
    for title in ("errors", "warnings"):
        if s[title]:
            p(f"{title}:")
            for key, n in s[title].items():
                p(f"  {n:>8}  {key}")
    p("\npercentiles (requests that ended ok)")
    p(f"  {'':<18}{'count':>9}{'mean':>11}{'p50':>11}{'p90':>11}{'p99':>11}{'max':>11}")
    for name, d in s["percentiles"].items():
        p(f"  {name:<18}{d['count']:>9}" + "".join(f"{d[k]:>11.4g}" for k in ("mean", "p50", "p90", "p99", "max")))
    p(f"\nthroughput per {s['window_s']:g} s window (times from the first finished request)")
    p(f"  {'start s':>8}{'requests':>10}{'errors':>8}{'req/s':>9}{'gen tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}")
    for w in s["windows"]:
        p(
            f"  {w['start_s']:>8.0f}{w['requests']:>10}{w['errors']:>8}{_f(w['requests_per_s'], 2):>9}"
            f"{_f(w['generated_tok_per_s'], 1):>11}{_g(w['ttft_p50_s']):>10}{_g(w['ttft_p99_s']):>10}"
        )
    p(f"\nslowest {len(s['slowest'])} (end to end)")
    for r in s["slowest"]:
        p(
            f"  {r['request_id']}  {r['timestamp']}  {r['endpoint']} {r['outcome']} {r['status']}"
            f"  e2e {_g(r['e2e_s'])} s  ttft {_g(r['ttft_s'])} s  queue {_g(r['queue_time_s'])} s"
            f"  prompt {r['prompt_tokens']}  generated {r['generated_tokens']}"
        )


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _f(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def plot(s: dict[str, Any], out: str | Path) -> None:
    """TTFT percentiles and throughput per window, one PNG (Agg, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    minutes = [w["start_s"] / 60 for w in s["windows"]]
    fig = Figure(figsize=(10, 7), layout="constrained")
    FigureCanvasAgg(fig)
    ax_ttft, ax_tput = fig.subplots(2, 1, sharex=True)
    for q in ("p50", "p90", "p99"):
        ax_ttft.plot(minutes, [_nan(w[f"ttft_{q}_s"]) for w in s["windows"]], marker=".", label=f"TTFT {q}")
    ax_ttft.set_ylabel("seconds")
    ax_ttft.set_title(f"time to first token per {s['window_s']:g} s window")
    ax_ttft.legend()
    ax_tput.plot(minutes, [_nan(w["generated_tok_per_s"]) for w in s["windows"]], marker=".", color="tab:green")
    ax_tput.set_ylabel("generated tok/s", color="tab:green")
    ax_req = ax_tput.twinx()
    ax_req.plot(
        minutes, [_nan(w["requests_per_s"]) for w in s["windows"]], marker=".", linestyle="--", color="tab:purple"
    )
    ax_req.set_ylabel("requests/s", color="tab:purple")
    ax_tput.set_xlabel("minutes since the first finished request")
    ax_tput.set_title("throughput")
    fig.savefig(out, dpi=100)


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


# command line


def add_parser(sub: argparse._SubParsersAction) -> None:
    logs = sub.add_parser("logs", help="summarize or plot a JSON log written by `serve`")
    cmds = logs.add_subparsers(dest="logs_command", required=True)
    summary = cmds.add_parser("summary", help="counts, errors, percentiles, throughput per window, slowest requests")
    summary.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    summary.add_argument("--slowest", type=int, default=10, help="how many of the slowest requests to list")
    summary.set_defaults(func=_summary)
    plotter = cmds.add_parser("plot", help="TTFT and throughput over time as a PNG")
    plotter.add_argument("--out", required=True, help="the PNG to write")
    plotter.set_defaults(func=_plot, slowest=0)
    for p in (summary, plotter):
        p.add_argument("log", help="a log file of JSON lines")
        p.add_argument("--window", type=float, default=60.0, help="window length in seconds")


def _summary(args: argparse.Namespace) -> int:
    s = summarize(args.log, args.window, args.slowest)
    if args.json:
        print(json.dumps(s))
    else:
        print_summary(s)
    return 0


def _plot(args: argparse.Namespace) -> int:
    s = summarize(args.log, args.window, 0)
    plot(s, args.out)
    print(f"wrote {args.out}: {s['num_requests']} requests in {len(s['windows'])} windows")
    return 0
