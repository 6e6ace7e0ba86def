"""Pure: per-request results -> vLLM-style summary figures and the printed report."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    status: int | None = None
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0                     # seconds
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0                  # end-to-end, seconds
    start: float = 0.0


def _pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


METRICS = ("ttft", "tpot", "itl", "e2el")


def pct_word(p: float) -> str:
    """vLLM's spelling of a percentile in keys and labels: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if float(p).is_integer() else str(p)


def _dist(name: str, values_s: list[float], percentiles=(99.0,)) -> dict:
    ms = [v * 1000.0 for v in values_s]
    out = {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
           f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
           f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0,
           f"p99_{name}_ms": _pct(ms, 99)}
    for p in percentiles:
        out[f"p{pct_word(p)}_{name}_ms"] = _pct(ms, p)
    return out


def summarize(results: list[RequestResult], duration: float,
              percentiles: tuple[float, ...] = (99.0,)) -> dict:
    """The figures; `p99_*_ms` always, plus `p{X}_*_ms` for each of `percentiles`."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            key = str(r.status) if r.status else (r.error.split(":")[0] or "error")
            errors[key] = errors.get(key, 0) + 1
    out = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors_by_status": errors,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
    }
    out.update(_dist("ttft", [r.ttft for r in ok], percentiles))
    out.update(_dist("tpot", tpots, percentiles))
    out.update(_dist("itl", [x for r in ok for x in r.itl], percentiles))
    out.update(_dist("e2el", [r.latency for r in ok], percentiles))
    return out


def format_report(s: dict, metrics: tuple[str, ...] = METRICS,
                  percentiles: tuple[float, ...] = (99.0,)) -> str:
    """vLLM's report; `metrics` and `percentiles` as its --percentile-metrics and
    --metric-percentiles pick them (the figures must hold those percentiles)."""
    def row(label: str, value, fmt: str = "{:<10.2f}") -> str:
        v = fmt.format(value) if isinstance(value, float) else str(value)
        return f"{label:<40} {v}"

    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
             row("Successful requests:", s["completed"]),
             row("Failed requests:", s["failed"]),
             row("Benchmark duration (s):", s["duration"]),
             row("Total input tokens:", s["total_input_tokens"]),
             row("Total generated tokens:", s["total_output_tokens"]),
             row("Request throughput (req/s):", s["request_throughput"]),
             row("Output token throughput (tok/s):", s["output_throughput"]),
             row("Total Token throughput (tok/s):", s["total_token_throughput"])]
    for key, title in (("ttft", "Time to First Token"),
                       ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        if key not in metrics:
            continue
        lines.append("{s:{c}^50}".format(s=f" {title} ", c="-"))
        stats = [("Mean", "mean"), ("Median", "median")] + [
            (f"P{pct_word(p)}", f"p{pct_word(p)}") for p in percentiles]
        for label, stat in stats:
            lines.append(row(f"{label} {key.upper()} (ms):", s[f"{stat}_{key}_ms"]))
    if s["errors_by_status"]:
        lines.append(row("Errors:", ", ".join(f"{k}: {v}" for k, v in
                                              sorted(s["errors_by_status"].items()))))
    if "client_cpu_util" in s:
        lines.append(row("Client CPU per process (cores):",
                         " ".join(f"{c:.2f}" for c in s["client_cpu_util"])))
    lines.append("=" * 50)
    if s.get("client_saturated"):
        lines.append("WARNING: a client process was busy nearly a whole core: these figures "
                     "measure the client as much as the server. Rerun with a larger "
                     "--num-client-procs.")
    return "\n".join(lines)
