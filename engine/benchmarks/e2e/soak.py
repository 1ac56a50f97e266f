"""`sloserve bench soak`: N concurrent clients for T seconds against a real `sloserve serve`.

Each client loops over a seeded random mix of streaming and non-streaming completions and chat
with mixed TTFT objectives (urgent, relaxed, none), clients that hang up mid-request on purpose,
and bad inputs sent on purpose (non-finite floats, integers beyond 64 bits, wrong types, an
unknown model, over-long prompts, malformed JSON), which must come back as 4xx.

Every request ends as one of: completed; dropped on purpose (the client hung up); rejected as
expected (a bad input answered with a 4xx error body); lost (anything else: a 5xx, a connection
error, a timeout, a stream without [DONE] or a finish_reason, an error event, a bad input
accepted). Afterwards the server must go idle with its KV cache free and still answer.
Prints a table (stderr) and a JSON summary (stdout); exits 1 if anything was lost, a 5xx or a
traceback was seen, or the KV cache was not freed.

  sloserve bench soak --clients 64 --duration-s 120
  sloserve bench soak --model /path/to/hf-folder --clients 8 --duration-s 20 -- --dtype float32
  sloserve bench soak --url http://127.0.0.1:8000 --clients 16

Arguments after `--` are passed to `sloserve serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil

from engine.benchmarks.measure.figures import print_result
from engine.benchmarks.server import launched_server
from engine.benchmarks.standalone import standalone_main
from engine.benchmarks.measure.stats import percentile
from engine.benchmarks.e2e.soak_clients import SLOS, Tally, Target, run_clients

# Every one of them is 0 on an idle server that freed what its requests held.
IDLE_GAUGES = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")


# ---- the server ---------------------------------------------------------------------------------

@contextmanager
def started_server(args: argparse.Namespace, server_args: list[str]
                   ) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    """`sloserve serve` on a free loopback port: yields (url, process, log path); SIGTERM after."""
    serve_args = ["--log-level", "warning", *(["--model", args.model] if args.model else []),
                  *(["--api-key", args.api_key] if args.api_key else []), *server_args]
    log_path = Path(args.server_log or tempfile.mkstemp(prefix="soak-server-", suffix=".log")[1])
    log_path.write_bytes(b"")  # this run's log alone
    with launched_server(serve_args, log_path=log_path,
                         startup_timeout_s=args.startup_timeout_s) as server:
        yield server.url, server.process, log_path


def listening_pid(url: str) -> int | None:
    """The process listening on `url`'s port, when this user may see it (attach mode)."""
    port = httpx.URL(url).port
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                return conn.pid
    except psutil.Error:
        pass
    return None


def rss_mib(pid: int | None) -> dict[str, Any] | None:
    """Resident memory of the server and every process under it (EngineCore, TP workers)."""
    if pid is None:
        return None
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    procs = []
    for proc in tree:
        try:
            cmd = " ".join(proc.cmdline())
            role = ("api_server" if proc.pid == pid else "resource_tracker"
                    if "resource_tracker" in cmd else "engine_core"
                    if proc.ppid() == pid else "worker")
            procs.append({"pid": proc.pid, "role": role,
                          "rss_mib": round(proc.memory_info().rss / 2**20, 1)})
        except psutil.Error:  # exited meanwhile
            pass
    return {"total": round(sum(p["rss_mib"] for p in procs), 1), "processes": procs}


def scrape_metrics(http: httpx.Client) -> dict[str, float]:
    """The engine's gauges and its preemption / monitor-error counters from /metrics (summed
    over labels except a preemption's reason)."""
    from prometheus_client.parser import text_string_to_metric_families

    response = http.get("/metrics")
    response.raise_for_status()
    found = dict.fromkeys(IDLE_GAUGES, 0.0)
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            name = sample.name.removeprefix("sloserve:")
            if name == "num_preemptions_total":
                name = f"preemptions_{sample.labels.get('reason', '?')}"
            elif name not in IDLE_GAUGES and name != "monitor_errors_total":
                continue
            found[name] = found.get(name, 0.0) + sample.value
    return found


def after_run(target: Target, idle_timeout_s: float) -> dict[str, Any]:
    """Waits for the server to go idle; its gauges, KV blocks, and whether it still answers."""
    out: dict[str, Any] = {"idle": False}
    with httpx.Client(base_url=target.url, headers=target.headers, timeout=30.0) as http:
        started = time.monotonic()
        try:
            while True:
                found = scrape_metrics(http)
                busy = any(found[name] for name in IDLE_GAUGES)
                if not busy or time.monotonic() - started > idle_timeout_s:
                    break
                time.sleep(0.2)
            out.update(found, idle=not busy,
                       idle_wait_s=round(time.monotonic() - started, 2))
            stats = http.get("/debug/stats").json()
            out["num_free_blocks"] = stats["num_free_blocks"]
            out["num_blocks"] = stats["num_blocks"]
            response = http.post("/v1/completions", json={"prompt": "The river", "max_tokens": 4,
                                                          "temperature": 0})
            out["answers_after"] = response.status_code == 200
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
            out.setdefault("answers_after", False)
    return out


def describe_target(args: argparse.Namespace, url: str, headers: dict[str, str]) -> Target:
    model = httpx.get(f"{url}/v1/models", headers=headers, timeout=30.0).json()["data"][0]
    slos = (("urgent", args.urgent_slo_ms), ("relaxed", args.relaxed_slo_ms), ("none", None))
    return Target(url, model["id"], int(model["max_model_len"]), headers, slos)


# ---- the summary --------------------------------------------------------------------------------

def ttft_summary(target: Target, ttft_ms: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    """Client-side time to the first event, per SLO class (hang-ups included: they stream too)."""
    out = {}
    for label, slo in target.slos:
        values = ttft_ms.get(label, [])
        if values:
            out[label] = {"n": len(values), "p50_ms": round(percentile(values, 50), 1),
                          "p99_ms": round(percentile(values, 99), 1)}
            if slo is not None:
                out[label]["met"] = round(sum(v <= slo for v in values) / len(values), 3)
    return out


def summarize(args: argparse.Namespace, server_args: list[str], target: Target, tally: Tally,
              elapsed_s: float, after: dict[str, Any], rss: dict[str, Any],
              log_path: Path | None) -> dict[str, Any]:
    log_tracebacks, log_tail = None, None
    if log_path is not None:
        log = log_path.read_text(errors="replace")
        log_tracebacks = log.count("Traceback (most recent call last)")
        if log_tracebacks:
            log_tail = log[log.rindex("Traceback"):][:3000]
    o = tally.outcomes
    failures = [text for bad, text in (
        (o["lost"], f"{o['lost']} requests lost"),
        (tally.status_5xx, f"{tally.status_5xx} responses with a 5xx status"),
        (tally.tracebacks, f"{tally.tracebacks} tracebacks in bodies or events"),
        (log_tracebacks, f"{log_tracebacks} tracebacks in the server log"),
        (not after.get("idle"), f"server not idle {args.idle_timeout_s:g} s after the run"),
        (after.get("kv_cache_usage_perc", 1.0) != 0.0, "KV cache not freed when idle"),
        (not after.get("answers_after"), "server does not answer a request after the run"),
        (after.get("monitor_errors_total"), "the SLO monitor thread caught exceptions"),
        (sum(o.values()) != tally.sent, "requests sent and outcomes do not add up"),
    ) if bad]
    return {
        "config": {"clients": args.clients, "duration_s": args.duration_s, "seed": args.seed,
                   "model": target.model_name, "max_model_len": target.max_model_len,
                   "max_tokens": args.max_tokens, "url": args.url,
                   "slos_ms": dict(target.slos),
                   "server_args": server_args if args.url is None else None},
        "elapsed_s": round(elapsed_s, 1),
        "requests_sent": tally.sent,
        "completed": o["completed"],
        "dropped_on_purpose": o["dropped_on_purpose"],
        "rejected_as_expected": o["rejected_as_expected"],
        "lost": o["lost"],
        "status_5xx": tally.status_5xx,
        "tracebacks_seen": tally.tracebacks,
        "server_log_tracebacks": log_tracebacks,
        "kv_usage_after": after.get("kv_cache_usage_perc"),
        "after": after,
        "rss_mib": rss,
        "ttft": ttft_summary(target, tally.ttft_ms),
        "slowest_requests": [{"seconds": t, "kind": k, "request": shape}
                             for t, k, shape in tally.slowest],
        "by_kind": {k: dict(v) for k, v in sorted(tally.by_kind.items())},
        "bad_input_statuses": {k: dict(v) for k, v in sorted(tally.bad_inputs.items())},
        "lost_reasons": dict(tally.lost_reasons.most_common()),
        "lost_examples": tally.lost_examples,
        "server_log_last_traceback": log_tail,
        "failures": failures,
        "ok": not failures,
    }


def table(s: dict[str, Any]) -> str:
    start, end = (s["rss_mib"].get(k) or {} for k in ("start", "end"))

    def rss(snapshot: dict[str, Any]) -> str:
        if not snapshot:
            return "?"
        parts = ", ".join(f"{p['role']} {p['rss_mib']:.0f}" for p in snapshot["processes"])
        return f"{snapshot['total']:.0f} MiB ({parts})"

    rows = [("clients x seconds", f"{s['config']['clients']} x {s['config']['duration_s']:g} "
                                  f"(ran {s['elapsed_s']:g} s)"),
            ("requests sent", s["requests_sent"]), ("completed", s["completed"]),
            ("dropped on purpose", s["dropped_on_purpose"]),
            ("bad inputs rejected (4xx)", s["rejected_as_expected"]), ("lost", s["lost"]),
            ("5xx responses", s["status_5xx"]), ("tracebacks seen", s["tracebacks_seen"]),
            ("tracebacks in server log", s["server_log_tracebacks"]),
            ("KV usage after (idle)", s["kv_usage_after"]),
            ("preemptions (kv / slo)", " / ".join(
                f"{s['after'][k]:g}" if k in s["after"] else "0" for k in
                ("preemptions_kv", "preemptions_slo"))),
            ("server RSS start", rss(start)), ("server RSS end", rss(end))]
    rows += [(f"TTFT {label}", f"p50 {t['p50_ms']:.0f} ms, p99 {t['p99_ms']:.0f} ms"
              + (f", met {100 * t['met']:.1f}%" if "met" in t else ""))
             for label, t in s["ttft"].items()]
    if s["slowest_requests"]:
        slow = s["slowest_requests"][0]
        rows.append(("slowest request", f"{slow['seconds']:g} s, {slow['kind']} "
                                        f"({slow['request'] or 'bad input'})"))
    rows += [(f"lost: {reason}", n) for reason, n in s["lost_reasons"].items()]
    rows.append(("result", "OK" if s["ok"] else "FAIL: " + "; ".join(s["failures"])))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


# ---- main ---------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=120.0,
                        help="no request starts after this; those in flight are awaited")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None,
                        help="model folder for the server this starts (default: the default model)")
    parser.add_argument("--url", default=None,
                        help="attach to a running server instead of starting one")
    parser.add_argument("--api-key", default=os.environ.get("SLOSERVE_API_KEY"))
    parser.add_argument("--urgent-slo-ms", type=float, default=SLOS[0][1],
                        help="TTFT objective of the urgent class")
    parser.add_argument("--relaxed-slo-ms", type=float, default=SLOS[1][1],
                        help="TTFT objective of the relaxed class")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="the most tokens a request asks for")
    parser.add_argument("--max-requests", type=int, default=100_000,
                        help="stop starting requests after this many")
    parser.add_argument("--request-timeout-s", type=float, default=300.0,
                        help="a request without its answer after this is lost (64 clients "
                             "on a few CPU cores can take minutes per long prompt)")
    parser.add_argument("--idle-timeout-s", type=float, default=30.0,
                        help="how long the server may take to go idle after the run")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--server-log", default=None, help="keep the started server's log here")
    parser.add_argument("--output", default=None, metavar="PATH",
                        help="also write the JSON summary here")
    # After `--`: argparse hands everything that follows to this positional, options included.
    parser.add_argument("server_args", nargs="*", metavar="-- SERVE_ARG",
                        help="arguments after `--` are passed to `sloserve serve`")


def soak(args: argparse.Namespace, server_args: list[str]) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.url is not None:
        url = args.url.rstrip("/")
        target, pid = describe_target(args, url, headers), listening_pid(url)
        rss_start = rss_mib(pid)
        tally, elapsed = asyncio.run(run_clients(target, args))
        after = after_run(target, args.idle_timeout_s)
        return summarize(args, server_args, target, tally, elapsed, after,
                         {"start": rss_start, "end": rss_mib(pid)}, None)
    with started_server(args, server_args) as (url, proc, log_path):
        target = describe_target(args, url, headers)
        rss_start = rss_mib(proc.pid)
        tally, elapsed = asyncio.run(run_clients(target, args))
        after = after_run(target, args.idle_timeout_s)
        rss_end = rss_mib(proc.pid)
    summary = summarize(args, server_args, target, tally, elapsed, after,
                        {"start": rss_start, "end": rss_end}, log_path)
    summary["server_log"] = str(log_path)
    return summary


def run(args: argparse.Namespace) -> int:
    """`sloserve bench soak`: 0 when nothing was lost, 1 when something was, 2 when the server
    did not start."""
    server_args = list(args.server_args)
    if args.url is not None and server_args:
        print("soak: server arguments after `--` need a server to start (no --url)",
              file=sys.stderr)
        return 2
    try:
        summary = soak(args, server_args)
    except RuntimeError as exc:  # the server did not start: its log says why
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    print(table(summary), file=sys.stderr)
    print_result(summary, args.output)
    return 0 if summary["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    """As a script (bench/e2e/): the same options as the subcommand."""
    return standalone_main(__doc__.split("\n\n")[0], add_arguments, run, argv)
