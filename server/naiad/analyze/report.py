"""The analysis' outputs: a table, a throughput-vs-latency chart (PNG), an HTML report and the winning config."""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

from google.protobuf import text_format

from .. import config as model_config
from .sweep import Result

COLUMNS = (
    "config",
    "concurrency",
    "throughput/s",
    "p50 ms",
    "p99 ms",
    "server cores",
    "server MiB",
    "client cores",
    "host cpu",
    "host MiB",
    "within budget",
)


def ranking(results: list[Result], budget_ms: float) -> list[tuple[Result, object]]:
    """Configs that meet the budget, by their best throughput within it (most first), as Model Analyzer ranks."""
    ranked = [(r, r.best(budget_ms)) for r in results if not r.error]
    ranked = [(r, m) for r, m in ranked if m is not None]
    ranked.sort(key=lambda rm: rm[1].throughput, reverse=True)
    return ranked


def rows(results: list[Result], budget_ms: float) -> list[tuple]:
    out = []
    for r in results:
        if r.error:
            out.append((r.variant.name, *("-" * 9), f"failed: {r.error[:80]}"))
            continue
        for m in r.measurements:
            out.append(
                (
                    r.variant.name,
                    str(m.concurrency),
                    f"{m.throughput:.1f}",
                    f"{m.p50_ms:.2f}",
                    f"{m.p99_ms:.2f}",
                    _num(r.server_cpu, "{:.2f}"),
                    _num(r.server_rss / 2**20, "{:.0f}"),
                    _num(r.client_cpu, "{:.2f}"),
                    _num(r.cpu_utilization, "{:.2f}"),
                    _num(r.memory_bytes / 2**20, "{:.0f}"),
                    "yes" if m.errors == 0 and m.p99_ms <= budget_ms else "no",
                )
            )
    return out


# Cores busy with other work (host nv_cpu_utilization x cores - server - load generator) above which a variant's
# figures measure the contention as much as the variant.
BUSY_CORES = 0.5


def busy_host(results: list[Result]) -> list[str]:
    """Variants measured while other work kept the host's CPUs busy: their ranking is not to be trusted."""
    return [r.variant.name for r in results if not r.error and r.other_cpu > BUSY_CORES]


def _num(value: float, fmt: str) -> str:
    return "-" if math.isnan(value) else fmt.format(value)


def table(results: list[Result], budget_ms: float) -> str:
    """A plain-text table of every measurement."""
    body = rows(results, budget_ms)
    widths = [max(len(str(x)) for x in col) for col in zip(COLUMNS, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*COLUMNS), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*row) for row in body]
    return "\n".join(lines)


def chart(results: list[Result], budget_ms: float, path: Path, title: str) -> None:
    """Throughput (x) against p99 latency (y), one line per config over its concurrency sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    for r in results:
        if r.error or not r.measurements:
            continue
        xs = [m.throughput for m in r.measurements]
        ys = [m.p99_ms for m in r.measurements]
        ax.plot(xs, ys, marker="o", label=r.variant.name)
        for m in r.measurements:
            ax.annotate(str(m.concurrency), (m.throughput, m.p99_ms), fontsize=7, alpha=0.6)
    ax.axhline(budget_ms, color="red", linestyle="--", linewidth=1, label=f"p99 budget {budget_ms:g} ms")
    ax.set_xlabel("throughput (inferences/s)")
    ax.set_ylabel("p99 latency (ms)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def config_pbtxt(config: dict) -> str:
    """A `/config` JSON document as config.pbtxt text."""
    return text_format.MessageToString(model_config.parse_json(json.dumps(config)))


def busy_warning(names: list[str]) -> str:
    return (
        f"other work kept more than {BUSY_CORES:g} core busy while {len(names)} variant(s) were measured "
        f"({', '.join(names)}): it competed with the server and the load generator, so rerun on a quiet "
        "machine before trusting their ranking"
    )


def html_report(results: list[Result], budget_ms: float, png: Path, winner: Result | None, title: str) -> str:
    img = base64.b64encode(png.read_bytes()).decode()
    head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(x))}</td>" for x in row) + "</tr>"
        for row in rows(results, budget_ms)
    )
    if winner is not None:
        m = winner.best(budget_ms)
        verdict = (
            f"<p>Best within a p99 of {budget_ms:g} ms: <b>{html.escape(winner.variant.name)}</b>, "
            f"{m.throughput:.1f} inferences/s at concurrency {m.concurrency} (p99 {m.p99_ms:.2f} ms).</p>"
            f"<h2>config.pbtxt</h2><pre>{html.escape(config_pbtxt(winner.config))}</pre>"
        )
    else:
        verdict = f"<p>No configuration met a p99 of {budget_ms:g} ms.</p>"
    busy = busy_host(results)
    if busy:
        verdict += f"<p><b>Warning:</b> {html.escape(busy_warning(busy))}</p>"
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>{verdict}<img src='data:image/png;base64,{img}' alt='throughput vs p99'>"
        f"<h2>Measurements</h2><table><tr>{head}</tr>{body}</table></body></html>"
    )
