"""`sloserve bench flood`: ten times a server's queue bound in requests, all at once.

Starts `sloserve serve` with `--max-num-queued-reqs B` (`--queue-bound`, default 8), or a fleet
of simulated replicas (`--replicas N`, each replica holding at most B), or attaches to a running
server (`--url`), and sends it 10 x B streaming requests at the same moment (`--num-requests`): a
share of urgent chat turns with tight TTFT objectives (150-300 ms at GPU time scales) among
relaxed requests with long prompts (engine/benchmarks/flood/client.py). What a flood must
get: only 429s and completed 200s, never a 5xx; every accepted request complete (a
finish_reason and [DONE]); the urgent requests among the accepted within their objectives,
timed by the client to the first chunk carrying output; and the server's own rejection
counters equal to the client's 429s (engine/benchmarks/flood/report.py).

By default the server runs the GPU-timed simulation (`--simulate h100-llama-3.1-8b`: an H100
serving Llama-3.1-8B, on a model folder of its shape with the default model's tokenizer), so
the flood runs at GPU time scales on a laptop; `--simulate none` serves the real model (the
default model, or `--model`), with objectives sized for it on a CPU (`cpu-bursts`'s). The
simulated GPUs cost no CPU, but the client, the HTTP server's tokenizing and a fleet's Ray Serve
hops do, on this host's cores: `--time-scale K` runs the flood in slow motion (the profile's
steps and the objectives K times as long, every figure reported back in the profile's time), so
that they weigh 1/K, as `sloserve bench run --time-scale` does.

Prints a table; OUTPUT_DIR/flood.json holds the configuration, the summary, the server's
counters and every request's record (status, TTFB and TTFT by the client's clock, completion,
Retry-After and the error body of a 429), OUTPUT_DIR/server.log the started server's log.
Exits 1 on a 5xx, an accepted request that did not complete, an answer other than 200 or 429,
or counters that disagree with the client, and when the server failed its warm-up requests or
its /metrics; 2 when there was no server to flood (it did not start, or could not be reached,
or lists no model).

  sloserve bench flood --output-dir flood-one
  sloserve bench flood --on-doomed reject --output-dir flood-one-reject
  sloserve bench flood --replicas 3 --on-doomed reject --output-dir flood-fleet
  sloserve bench flood --time-scale 4 --output-dir flood-one-x4
  sloserve bench flood --url http://127.0.0.1:8000 --queue-bound 8
  sloserve bench flood --simulate none -- --dtype bfloat16

Arguments after `--` are passed to `sloserve serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx

from engine.benchmarks.attainment.traces import Uniform
from engine.benchmarks.flood.client import (CPU_MIX, GPU_MIX, RELAXED_ROUTES, FloodRequest,
                                            Linear, Mix, Record, build_flood, flood)
from engine.benchmarks.flood.report import (REROUTED_COUNTER, counter_deltas,
                                            rejection_counters, summarize, table)
from engine.benchmarks.fleet.fleet_run import HealthSampler
from engine.benchmarks.standalone import standalone_main

DEFAULT_PROFILE = "h100-llama-3.1-8b"
DEFAULT_QUEUE_BOUND = 8
# A simulated server's context: the relaxed prompts (up to 16k tokens) fit.
SIMULATED_MAX_MODEL_LEN = 32768


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--queue-bound", type=int, default=DEFAULT_QUEUE_BOUND, metavar="B",
                        help="--max-num-queued-reqs of the server this starts (each replica's "
                             "in a fleet); with --url, the bound that server has")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="requests sent at once (default: 10 x --queue-bound)")
    parser.add_argument("--urgent-share", type=float, default=0.5,
                        help="share of the requests that are urgent chat turns")
    parser.add_argument("--on-doomed", choices=("serve", "reject"), default="serve",
                        help="the server's --on-doomed (a fleet's ingress judges for the fleet)")
    parser.add_argument("--replicas", type=int, default=None, metavar="N",
                        help="start a fleet of N replicas on Ray Serve instead of one server")
    parser.add_argument("--simulate", default=DEFAULT_PROFILE, metavar="PROFILE",
                        help=f"the server's --simulate profile (default {DEFAULT_PROFILE}); "
                             f"'none': the real model")
    parser.add_argument("--model", default=None,
                        help="model folder (default: a folder of the profile's shape with the "
                             "default model's tokenizer; without --simulate, the default "
                             "model); with --url, where the tokenizer is read (default: the "
                             "served model's root)")
    parser.add_argument("--url", default=None,
                        help="flood a running server instead of starting one")
    parser.add_argument("--api-key", default=os.environ.get("SLOSERVE_API_KEY"))
    parser.add_argument("--urgent-prompt-tokens", type=int, nargs=2, default=None,
                        metavar=("LO", "HI"), help="urgent turns' message length, uniform")
    parser.add_argument("--urgent-slo-ms", type=float, nargs=2, default=None,
                        metavar=("LO", "HI"), help="urgent objectives, linear in the length "
                                                   "from LO (shortest) to HI (longest)")
    parser.add_argument("--relaxed-prompt-tokens", type=int, nargs=2, default=None,
                        metavar=("LO", "HI"), help="relaxed prompts' length, uniform")
    parser.add_argument("--relaxed-slo-ms", type=float, nargs=2, default=None,
                        metavar=("LO", "HI"))
    parser.add_argument("--relaxed-route", choices=RELAXED_ROUTES, default="chat",
                        help="how the relaxed requests come: chat turns (a pasted document, "
                             "templated and tokenized by the server, as the urgent turns are) "
                             "or completions of token ids (which skip that work and so reach "
                             "the queue bound first)")
    parser.add_argument("--time-scale", type=float, default=1.0, metavar="K",
                        help="the flood in slow motion (a simulated server this starts): the "
                             "profile's steps and the objectives K times as long, a fleet's "
                             "reports K times less often, every figure reported back in the "
                             "profile's time, so that this host's own costs weigh 1/K "
                             "(engine/benchmarks/attainment/time_scale.py)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout-s", type=float, default=300.0,
                        help="a request without its answer after this did not complete")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--output-dir", "--output", default=None, metavar="DIR",
                        help="write flood.json (summary and every request's record) and the "
                             "started server's log here")
    # After `--`: argparse hands everything that follows to this positional, options included.
    parser.add_argument("server_args", nargs="*", metavar="-- SERVE_ARG",
                        help="arguments after `--` are passed to `sloserve serve`")


def flood_mix(args: argparse.Namespace) -> Mix:
    mix = CPU_MIX if _real_model(args) else GPU_MIX
    if args.urgent_prompt_tokens:
        mix = replace(mix, urgent_prompt=Uniform(*args.urgent_prompt_tokens))
    if args.relaxed_prompt_tokens:
        mix = replace(mix, relaxed_prompt=Uniform(*args.relaxed_prompt_tokens))
    if args.urgent_slo_ms or args.urgent_prompt_tokens:
        lo, hi = args.urgent_slo_ms or (mix.urgent_slo.lo_ms, mix.urgent_slo.hi_ms)
        mix = replace(mix, urgent_slo=Linear(mix.urgent_prompt.lo, lo, mix.urgent_prompt.hi, hi))
    if args.relaxed_slo_ms or args.relaxed_prompt_tokens:
        lo, hi = args.relaxed_slo_ms or (mix.relaxed_slo.lo_ms, mix.relaxed_slo.hi_ms)
        mix = replace(mix, relaxed_slo=Linear(mix.relaxed_prompt.lo, lo,
                                               mix.relaxed_prompt.hi, hi))
    return mix


def _real_model(args: argparse.Namespace) -> bool:
    return args.simulate in (None, "", "none")


def _has_flag(server_args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in server_args)


def serve_args(args: argparse.Namespace, model: str) -> list[str]:
    """The `sloserve serve` command line's arguments for the server (or fleet) this starts."""
    extra = list(args.server_args)
    # No --log-level: the server's follows $SLOSERVE_LOG_LEVEL (debug for its step lines).
    out = ["--model", model, "--max-num-queued-reqs", str(args.queue_bound),
           "--on-doomed", args.on_doomed]
    if not _real_model(args):
        out += ["--simulate", getattr(args, "slowed_profile", None) or args.simulate]
        if not _has_flag(extra, "--max-model-len"):
            out += ["--max-model-len", str(SIMULATED_MAX_MODEL_LEN)]
    if args.replicas is not None:
        out += ["--replicas", str(args.replicas)]
        if args.time_scale != 1.0 and not _has_flag(extra, "--report-period-ms"):
            # As fresh a view, in the profile's time, as a fleet at full speed has.
            out += ["--report-period-ms", f"{100.0 * args.time_scale:g}"]
    if args.api_key:
        out += ["--api-key", args.api_key]
    return out + extra


def _model_folder(args: argparse.Namespace, out_dir: Path) -> str:
    from engine.entrypoints.default_model import model_path_or_default

    if args.model or _real_model(args):
        return str(model_path_or_default(args.model))
    from engine.benchmarks.attainment.cli import _simulated_model

    return _simulated_model(args.simulate, out_dir.resolve())


def _write_slowed_profile(args: argparse.Namespace, model: str, folder: Path) -> str:
    """The profile with every duration --time-scale times as long, as a file for --simulate
    (kept in the output folder, when there is one, beside the server's log)."""
    import msgspec

    from engine.benchmarks.attainment.time_scale import slowed_profile
    from engine.runtime.model_setup import load_hf_config
    from engine.simulation.profile import load_profile

    profile = load_profile(args.simulate, load_hf_config(model).num_hidden_layers)
    path = (Path(args.output_dir) if args.output_dir else folder) / \
        f"profile-x{args.time_scale:g}.json"
    path.write_bytes(msgspec.json.encode(slowed_profile(profile, args.time_scale)))
    return str(path.resolve())


class FloodError(Exception):
    """Why a flood could not be run, and the exit code that says so: NO_SERVER when there was
    no server to flood, SERVER_FAILED when the server failed before the flood or around it
    (its warm-up, its /metrics). Every other exception is a fault of this tool and keeps its
    traceback."""

    NO_SERVER = 2
    SERVER_FAILED = 1

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _served_model(url: str, headers: dict[str, str]) -> dict[str, Any]:
    try:
        response = httpx.get(f"{url}/v1/models", headers=headers, timeout=30.0)
        response.raise_for_status()
        models = response.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise FloodError(f"{url}/v1/models: {type(exc).__name__}: {exc}",
                         FloodError.NO_SERVER) from exc
    if not models:
        raise FloodError(f"{url}/v1/models lists no model", FloodError.NO_SERVER)
    return models[0]


def _metrics(url: str, headers: dict[str, str]) -> str:
    try:
        response = httpx.get(f"{url}/metrics", headers=headers, timeout=30.0)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise FloodError(f"{url}/metrics: {type(exc).__name__}: {exc}",
                         FloodError.SERVER_FAILED) from exc
    return response.text


def _wait_fleet_ready(url: str, timeout_s: float) -> None:
    """A fleet answers /health 200 while still short of replicas ('degraded'): wait for ok."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(f"{url}/health", timeout=5.0).json()
            if last.get("status") == "ok":
                return
        except (httpx.HTTPError, ValueError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.5)
    raise FloodError(f"the fleet was not ready within {timeout_s:.0f} s: /health said {last}",
                     FloodError.NO_SERVER)


def _warm_up(url: str, headers: dict[str, str], requests: list[FloodRequest]) -> None:
    """A copy of the flood's first urgent and first relaxed request, one after the other and
    not streamed, before the flood: a fresh server's first requests pay first-call costs the
    flood should not (a long input's first tokenization loads the server's second tokenizer:
    engine/serving/tokenize_lanes.py). Each copy starts differently from its original, so
    neither finds the other in the prefix cache."""
    firsts = {r.kind: r for r in reversed(requests)}
    with httpx.Client(base_url=url, headers=headers, timeout=300.0) as http:
        for request in firsts.values():
            body = {**request.body, "stream": False, "max_tokens": 4}
            body.pop("stream_options", None)
            if "messages" in body:
                body["messages"] = [{"role": "user",
                                     "content": "warm-up " + body["messages"][0]["content"]}]
            else:
                body["prompt"] = body["prompt"][::-1]
            try:
                response = http.post(request.path, json=body)
            except httpx.HTTPError as exc:
                raise FloodError(f"the warm-up request to {request.path} failed: "
                                 f"{type(exc).__name__}: {exc}",
                                 FloodError.SERVER_FAILED) from exc
            if response.status_code != 200:
                raise FloodError(f"the warm-up request to {request.path} failed with HTTP "
                                 f"{response.status_code}: {response.text[:300]}",
                                 FloodError.SERVER_FAILED)


# A record's durations (ms), divided by --time-scale to report them in the profile's time; the
# server's own `server_metrics` object is kept as the server sent it (in the slowed time).
_RECORD_MS = ("sent_ms", "written_ms", "ttfb_ms", "ttft_ms", "e2e_ms", "server_ttft_ms",
              "predicted_ttft_ms", "routed_predicted_ttft_ms")


def restored(record: Record, scale: float) -> Record:
    if scale == 1.0:
        return record
    return replace(record, **{name: round(getattr(record, name) / scale, 2)
                              for name in _RECORD_MS if getattr(record, name) is not None})


def run_flood(args: argparse.Namespace, url: str, model_folder: str | None,
              headers: dict[str, str]) -> dict[str, Any]:
    """The flood against the server at `url`: its summary, records and counters."""
    from transformers import AutoTokenizer

    served = _served_model(url, headers)
    model_name = str(served["id"])
    tokenizer_folder = model_folder or args.model or served.get("root")
    if not tokenizer_folder:
        raise FloodError("--url: the server lists no model root; pass --model (the folder "
                         "of its tokenizer)", FloodError.NO_SERVER)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    mix = flood_mix(args)
    num_requests = args.num_requests or 10 * args.queue_bound
    # A chat template's few tokens, and the outputs, must fit beside each prompt.
    max_len = served.get("max_model_len")
    longest_output = max(mix.urgent_output_tokens, mix.relaxed_output_tokens)
    requests = build_flood(num_requests, args.urgent_share, mix, tokenizer, model_name,
                           args.seed, max_prompt_len=None if not max_len
                           else int(max_len) - longest_output - 64,
                           relaxed_route=args.relaxed_route)
    scale = args.time_scale
    for request in requests:  # K times the objective; the record keeps the profile's own
        request.body["ttft_slo_ms"] = round(request.ttft_slo_ms * scale, 3)
    _warm_up(url, headers, requests)
    metrics_before = _metrics(url, headers)
    before = rejection_counters(metrics_before)
    fleet = "sloserve:fleet_" in metrics_before
    with (HealthSampler(url) if fleet else contextlib.nullcontext()) as health:
        records, elapsed = asyncio.run(flood(url, requests, headers, args.request_timeout_s))
    records = [restored(r, scale) for r in records]
    elapsed /= scale
    metrics_after = _metrics(url, headers)
    counters = counter_deltas(before, rejection_counters(metrics_after))
    rerouted = counter_deltas(*(rejection_counters(text, (REROUTED_COUNTER,))
                                for text in (metrics_before, metrics_after)))
    # A server this started, or one on this host: one wall clock for both sides.
    same_host = args.url is None or httpx.URL(url).host in ("127.0.0.1", "localhost", "::1")
    summary = summarize(records, counters, fleet, elapsed, scale,
                        health.summary() if fleet else None,
                        rerouted.get(REROUTED_COUNTER) if fleet else None, same_host)
    config = {"url": args.url, "num_requests": num_requests, "queue_bound": args.queue_bound,
              "urgent_share": args.urgent_share, "relaxed_route": args.relaxed_route,
              "on_doomed": args.on_doomed,
              "replicas": args.replicas, "fleet": fleet,
              "simulate": None if _real_model(args) else args.simulate,
              "model": model_name, "tokenizer": str(tokenizer_folder),
              "max_model_len": max_len, "seed": args.seed, "mix": mix.describe(),
              "time_scale": scale, "request_timeout_s": args.request_timeout_s}
    return {"config": config, "summary": summary,
            "requests": [asdict(r) for r in records]}


def title(result: dict[str, Any]) -> str:
    c = result["config"]
    where = (f"a fleet of {c['replicas']} replicas" if c["replicas"] else
             "a fleet" if c["fleet"] else "one server")
    what = f"{c['simulate']} simulated" if c["simulate"] else c["model"]
    bound = (f"--max-num-queued-reqs {c['queue_bound']}" + (" per replica" if c["fleet"] else "")
             if c["url"] is None else f"queue bound {c['queue_bound']} (as given)")
    slowed = (f", {c['time_scale']:g}x slower (figures in the profile's time)"
              if c["time_scale"] != 1.0 else "")
    return (f"flood: {c['num_requests']} requests at once against {where} ({what}), {bound}, "
            f"--on-doomed {c['on_doomed']}{slowed}")


def _flood_started_server(args: argparse.Namespace, started_with: list[str], model: str,
                          out_dir: Path | None, headers: dict[str, str]) -> dict[str, Any]:
    from engine.benchmarks.server import launched_server

    log_path = (out_dir / "server.log") if out_dir is not None else None
    if log_path is not None:
        log_path.write_bytes(b"")  # this run's log alone
    print(f"flood: starting sloserve serve {' '.join(started_with)}", file=sys.stderr,
          flush=True)
    # Each server (each replica) calibrates its step-time model at startup as a user's does:
    # the ingress routes and refuses by those models.
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(launched_server(
                started_with, log_path=log_path, startup_timeout_s=args.startup_timeout_s))
        except RuntimeError as exc:  # it did not start: the exception holds its log
            raise FloodError(str(exc), FloodError.NO_SERVER) from exc
        if args.replicas is not None:
            _wait_fleet_ready(server.url, args.startup_timeout_s)
        result = run_flood(args, server.url, model, headers)
        result["config"]["server_startup_s"] = round(server.startup_s, 1)
    return result


def run(args: argparse.Namespace) -> int:
    """`sloserve bench flood`: 0 when the flood got only 429s and completed 200s and the
    counters agree, 1 otherwise (or when the server failed around the flood), 2 when there
    was no server to flood."""
    if args.queue_bound < 1 or (args.num_requests is not None and args.num_requests < 1):
        print("flood: --queue-bound and --num-requests must be at least 1", file=sys.stderr)
        return 2
    if args.url is not None and args.server_args:
        print("flood: server arguments after `--` need a server to start (no --url)",
              file=sys.stderr)
        return 2
    if not 1.0 <= args.time_scale < float("inf") or (args.time_scale != 1.0 and (
            args.url is not None or _real_model(args))):
        print("flood: --time-scale K (a number >= 1) slows down the simulated server this "
              "starts: not --url, nor --simulate none", file=sys.stderr)
        return 2
    out_dir = Path(args.output_dir) if args.output_dir else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    started_with = None
    try:
        if args.url is not None:
            result = run_flood(args, args.url.rstrip("/"), None, headers)
        else:
            # A simulated model's folder (its tokenizer is megabytes) is not kept in the output.
            with tempfile.TemporaryDirectory(prefix="sloserve-flood-") as scratch:
                model = _model_folder(args, Path(scratch))
                if args.time_scale != 1.0:
                    args.slowed_profile = _write_slowed_profile(args, model, Path(scratch))
                started_with = serve_args(args, model)
                result = _flood_started_server(args, started_with, model, out_dir, headers)
    except FloodError as exc:  # no server to flood, or it failed (its log says why)
        print(f"flood: {exc}", file=sys.stderr)
        return exc.exit_code
    result["config"]["server_args"] = started_with
    text = table(result["summary"], title(result))
    result["table"] = text
    print(text, flush=True)
    if out_dir is not None:
        (out_dir / "flood.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"flood: records and summary in {out_dir / 'flood.json'}", file=sys.stderr)
    return 0 if result["summary"]["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    """As a script: the same options as the subcommand."""
    return standalone_main(__doc__.split("\n\n")[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
