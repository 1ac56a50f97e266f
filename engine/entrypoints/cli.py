"""The `sloserve` command line: `sloserve generate "prompt"` (and `python -m engine ...`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from engine.benchmarks.cli import add_bench_parser
from engine.config import ShutdownConfig
from engine.entrypoints.arg_types import (float_in, int_in, non_negative_float, positive_float,
                                          positive_int)
from engine.entrypoints.calibrate import add_calibrate_parser
from engine.entrypoints.config_file import CONFIG_FLAG, ConfigFileError, expand_config
from engine.entrypoints.engine_args import add_engine_args, engine_kwargs, under_torchrun
from engine.fleet.cli_args import add_fleet_args
from engine.log import configure_logging
from engine.serving.admission import QueueBounds
from engine.serving.doomed import ON_DOOMED_CHOICES
from engine.serving.harmony import HARMONY_REASONING, HARMONY_TOOLS
from engine.serving.reasoning_parsers import REASONING_PARSERS
from engine.serving.tool_calls.parsers import PARSERS

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.entrypoints.llm import LLM
    from engine.serving.api_server import ServerSettings
    from engine.sampling_params import SamplingParams


def _generate(args: argparse.Namespace) -> int:
    from engine.entrypoints.llm import LLM
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sample_seed,
                            stop=args.stop or [])
    kwargs = engine_kwargs(args)
    # SIGTERM (torchrun stops every rank with it, `timeout` too) unwinds like Ctrl-C does:
    # through llm.shutdown() and the finalizers, which its default action would skip, leaving
    # the engine's shared memory to the resource tracker's "leaked" warning.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    if (code := under_torchrun(args, kwargs)) is not None:
        return code
    llm = LLM(**kwargs)
    try:
        return _generate_with(llm, args, params)
    finally:
        llm.shutdown()


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _generate_with(llm: LLM, args: argparse.Namespace, params: SamplingParams) -> int:
    chat = not args.no_chat and getattr(llm.tokenizer, "chat_template", None)
    started = time.monotonic()
    if chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        (out,) = llm.chat(messages, params)
    else:
        (out,) = llm.generate(args.prompt, params)
    elapsed = time.monotonic() - started
    print(out.text)
    m = out.metrics
    ttft = f"{m.ttft * 1000:.0f} ms" if m and m.ttft is not None else "n/a"
    print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}, TTFT {ttft}, "
          f"total {elapsed:.2f} s]", file=sys.stderr)
    return 0


def _check_slo_settings(default_ms: float | None, floor_ms: float | None) -> None:
    """The server's SLO flags together (argparse checked each one's range), before any model is
    prepared."""
    if default_ms is not None and floor_ms is not None and default_ms < floor_ms:
        raise ValueError(f"--default-ttft-slo-ms {default_ms:g} is below --min-ttft-slo-ms "
                         f"{floor_ms:g}: requests without an objective would get one the "
                         f"server refuses")


def model_argument(positional: str | None, flag: str | None) -> str | None:
    """`sloserve serve MODEL` and `sloserve serve --model MODEL` mean the same, as in vLLM."""
    if positional is not None and flag is not None and positional != flag:
        raise ValueError(f"the model is given twice and differently: {positional!r} as the "
                         f"positional MODEL and {flag!r} as --model; give it once")
    return flag if positional is None else positional


# Read when neither --api-key nor --api-key-file is given, in this order (vLLM reads the second).
API_KEY_ENV = ("SLOSERVE_API_KEY", "VLLM_API_KEY")


def api_key_from(flag: str | None, file: str | None, environ: Mapping[str, str]) -> str | None:
    """The server's API key: --api-key, else the first line of --api-key-file, else the
    environment. A file keeps the key out of `ps` and of the shell history."""
    if flag is not None:
        if not flag.strip():
            raise ValueError("--api-key must not be empty")
        return flag
    if file is not None:
        try:
            lines = Path(file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--api-key-file {file!r}: cannot read it: {exc}") from exc
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"--api-key-file {file!r}: its first line is empty; it must hold "
                             f"the key")
        return key
    return next((environ[name] for name in API_KEY_ENV if environ.get(name)), None)


def _serve(args: argparse.Namespace) -> int:
    import os

    from engine.entrypoints.default_model import model_path_or_default
    from engine.ipc.core_launch import CoreLaunch

    args.model = model_argument(args.model_tag, args.model)
    kwargs = engine_kwargs(args)
    if (code := under_torchrun(args, kwargs)) is not None:
        return code
    api_key = api_key_from(args.api_key, args.api_key_file, os.environ)
    if args.metrics_require_api_key and api_key is None:  # before any model is prepared
        raise ValueError("--metrics-require-api-key needs an API key (--api-key-file, "
                         "$SLOSERVE_API_KEY, $VLLM_API_KEY or --api-key)")
    _check_slo_settings(args.default_ttft_slo_ms, args.min_ttft_slo_ms)
    given = kwargs.pop("model")
    model = model_path_or_default(given)
    # EngineCore's process starts now and imports while this one checks the configuration
    # and loads the tokenizer; it builds nothing before the app's start tells it what
    # (engine.ipc.core_launch), and leaving this block ends it unless the server adopted it.
    # A fleet's replicas start their own.
    launch = CoreLaunch.start(model) if args.replicas is None else None
    with launch or contextlib.nullcontext():
        # Imported after the launch: torch and fastapi take seconds.
        from engine.serving.api_server import ServerSettings, run_server, served_name
        from engine.config import build_engine_config
        from engine.runtime.model_setup import resolve

        config = build_engine_config(model, **kwargs)
        resolve(config)  # bad configuration fails here, before the engine builds anything
        if config.slo_preemption.ttft_model:
            from monitor.step_time_model import StepTimeModel

            StepTimeModel.load(config.slo_preemption.ttft_model)
        # vLLM's convention: clients see the --model argument as given (tools load the tokenizer
        # from it); the default model, given by no one, is named after its folder.
        names = args.served_model_name or [given or served_name(model)]
        if not all(name.strip() for name in names):
            raise ValueError(f"--served-model-name: a name must not be empty, got {names}")
        settings = ServerSettings(
            served_model_name=names[0], other_served_names=tuple(names[1:]),
            model_root=str(Path(model).resolve()),
            api_key=api_key,
            max_request_body_bytes=args.max_request_body_bytes,
            default_ttft_slo_ms=args.default_ttft_slo_ms,
            min_ttft_slo_ms=args.min_ttft_slo_ms,
            default_tpot_slo_ms=args.default_tpot_slo_ms,
            metrics_require_api_key=args.metrics_require_api_key,
            shutdown=ShutdownConfig(mode=args.shutdown_mode, timeout_s=args.shutdown_timeout),
            tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
            queue_bounds=QueueBounds(args.max_num_queued_reqs, args.max_num_queued_tokens),
            on_doomed=args.on_doomed)
        if args.replicas is not None:
            return _serve_fleet(config, settings, args)
        run_server(config, settings, args.host, args.port,
                   os.environ.get("SLOSERVE_LOG_LEVEL", "info").lower(), launch)
        return 0


def _serve_fleet(config: EngineConfig, settings: ServerSettings,
                 args: argparse.Namespace) -> int:
    """`sloserve serve MODEL --replicas N`: N engines on Ray Serve behind one ingress."""
    from engine.fleet.cli_args import fleet_options

    options = fleet_options(args)  # bad flags fail before Ray starts
    try:
        import ray.serve  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"--replicas runs the fleet on Ray Serve, which is not installed "
                         f"({exc}); install the cluster extra: pip install -e '.[cluster]'"
                         ) from exc
    from engine.fleet.launch import serve_fleet

    serve_fleet(config, settings, options, args.host, args.port)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sloserve", description=__doc__,
        epilog="How it works: docs/design.md (processes, one step and its rollback, the "
               "preemption modes, the monitor's policy); where each concept lives: "
               "docs/architecture.md. Both are in the sloserve repository.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=positive_int, default=128)
    gen.add_argument("--temperature", type=non_negative_float, default=0.0,
                     help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float_in(0.0, 1.0, low_open=True), default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--no-chat", action="store_true",
                     help="send the prompt as is, without the model's chat template")
    gen.add_argument("--system", default=None, help="system message for chat models")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="local Hugging Face model folder, the same as --model (vLLM's "
                            "`vllm serve MODEL`)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int_in(1, 65535), default=8000)
    key = serve.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1, /tokenize and "
                          "/detokenize; other users of this machine see it in `ps`: prefer "
                          "--api-key-file or $SLOSERVE_API_KEY (or $VLLM_API_KEY), read when "
                          "neither flag is given")
    key.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="like --api-key, with the key read from the first line of PATH")
    serve.add_argument("--metrics-require-api-key", action="store_true",
                       help="require the API key on /metrics and /debug/stats too (/health "
                            "stays open)")
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="model names clients may use, the first in responses (default: "
                            "the --model argument as given; the folder's base name is always "
                            "accepted too)")
    serve.add_argument("--max-request-body-bytes", type=positive_int, default=1 << 20)
    serve.add_argument("--tool-call-parser", choices=sorted([*PARSERS, HARMONY_TOOLS]),
                       default=None,
                       help="the format the model writes tool calls in, for tool_choice auto "
                            "(default: the one its chat template shows, when exactly one; "
                            "openai: gpt-oss's harmony, on by itself with its template)")
    serve.add_argument("--reasoning-parser",
                       choices=sorted([*REASONING_PARSERS, HARMONY_REASONING]), default=None,
                       help="split a reasoning model's thinking (<think>...</think>) from its "
                            "answer: reasoning_content in messages and stream deltas "
                            "(openai_gptoss: harmony's analysis channel, on by itself with "
                            "gpt-oss's template)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="vLLM's switch for tool_choice auto, accepted as given: auto is "
                            "on wherever a tool-call parser is known")
    serve.add_argument("--default-ttft-slo-ms", type=non_negative_float, default=None,
                       help="TTFT objective for requests that carry none (default: none)")
    serve.add_argument("--default-tpot-slo-ms", type=positive_float, default=None,
                       help="time-per-output-token objective for requests that carry none "
                            "(default: none)")
    serve.add_argument("--min-ttft-slo-ms", type=non_negative_float, default=None,
                       help="the tightest TTFT objective a request may carry; a tighter one is "
                            "a 400 that names this floor (default: none)")
    serve.add_argument("--max-num-queued-reqs", type=positive_int, default=None, metavar="N",
                       help="the most requests the server holds, waiting or running (n samples "
                            "count as n); one more is refused with 429 and Retry-After "
                            "(default: no bound)")
    serve.add_argument("--max-num-queued-tokens", type=positive_int, default=None, metavar="N",
                       help="the most prompt tokens the server holds still to prefill; a "
                            "request past it is refused with 429 (one alone is always taken; "
                            "default: no bound)")
    serve.add_argument("--on-doomed", choices=ON_DOOMED_CHOICES, default="serve",
                       help="a request whose TTFT objective cannot be met even if it were "
                            "served ahead of everything queued (with --replicas: on no "
                            "replica): serve it anyway (default), or reject it at once with "
                            "429, its predicted_ttft_ms and a Retry-After")
    serve.add_argument("--shutdown-mode", choices=("abort", "wait"),
                       default=ShutdownConfig.mode,
                       help="on SIGTERM: abort (default) ends the requests in flight at once "
                            "(a stream with an error event); wait drains: new generation "
                            "requests get a 503 and /health a 503 {\"status\": \"draining\"} "
                            "while those in flight finish, then the server exits 0")
    serve.add_argument("--shutdown-timeout", type=non_negative_float,
                       default=ShutdownConfig.timeout_s, metavar="SECONDS",
                       help="with --shutdown-mode wait: the longest a drain waits before it "
                            "aborts what is left (default %(default)s)")
    serve.add_argument("--log-level", default=None, metavar="LEVEL",
                       help="debug, info, warning, error or critical: sloserve's own log in "
                            "every process (the engine core's step lines at debug) and "
                            "uvicorn's (default: $SLOSERVE_LOG_LEVEL, else info)")
    # Read (and replaced by the flags it holds) before parsing: engine.entrypoints.config_file.
    serve.add_argument(CONFIG_FLAG, metavar="FILE.yaml", default=None,
                       help="read flags from a YAML file, flag names as keys (vLLM's --config); "
                            "flags on the command line win")
    add_engine_args(serve)
    add_fleet_args(serve)
    serve.set_defaults(func=_serve)
    parser.config_commands = {"serve": serve}  # type: ignore[attr-defined]
    add_calibrate_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        argv = expand_config(sys.argv[1:] if argv is None else list(argv), parser,
                             parser.config_commands)  # type: ignore[attr-defined]
    except ConfigFileError as exc:
        print(f"sloserve: error: {exc}", file=sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0), or a usage error already printed (2)
        return exc.code if isinstance(exc.code, int) else 2
    if getattr(args, "log_level", None):
        # Exported, so the processes `serve` spawns (the engine core, its workers, a fleet's
        # replicas) log at the same level.
        os.environ["SLOSERVE_LOG_LEVEL"] = args.log_level
    try:
        configure_logging()
    except ValueError as exc:
        print(f"sloserve: error: {exc}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except KeyboardInterrupt:
        # Ctrl-C. `serve` has shut down gracefully by now (uvicorn re-raises the signal once
        # it has); either way the shell's status for it, without a traceback.
        return 128 + signal.SIGINT
    except ValueError as exc:  # bad input: a clear message, not a traceback
        print(f"sloserve: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a worker failed: its error text, then a non-zero exit
        print(f"sloserve: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
