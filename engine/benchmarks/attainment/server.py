"""A `sloserve serve` subprocess per benchmark cell, so that the HTTP runner measures each policy
on a fresh server (no prefix-cache hits carried over from the previous run).

`serve(..., log_path=PATH)` appends the server's log (info level) to PATH as the server writes
it, after a header line naming the cell, so the output folder keeps what each server did even
when the benchmark is killed; without a path the log is a temporary file at warning level,
quoted only when the server fails to start.

`serve(..., own_defaults=True)` starts the server as a user would (`sloserve bench run
--server-defaults`): no budget unless one is given, and no policy flags when the policy is the
engine's default; the overrides the caller passes (the machine's) still map onto flags."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine.benchmarks.attainment.policies import DEFAULT_SERVER_POLICY, PolicySpec
from engine.benchmarks.server import launched_server

# Engine overrides that map onto `sloserve serve` flags.
_FLAGS = {"dtype": "--dtype", "num_kv_blocks": "--num-kv-blocks",
          "max_model_len": "--max-model-len", "ttft_model": "--ttft-model",
          "slo_preempt_min_tokens": "--slo-preempt-min-tokens", "simulate": "--simulate",
          "device": "--device", "load_format": "--load-format"}


@contextmanager
def serve(policy: PolicySpec, budget: int | None, model: str, startup_timeout_s: float = 300.0,
          log_path: str | Path | None = None, log_header: str = "", own_defaults: bool = False,
          **engine_overrides: Any) -> Iterator[str]:
    """Yields the base URL of a server running `policy` at `budget` (None: the server's default
    budget); stops it afterwards. With `log_path`, the server's info-level log is appended there
    (after `log_header`'s line). `own_defaults`: the default policy is left to the server (no
    flags), as a user starting `sloserve serve` leaves it."""
    args = ["--model", model, "--log-level", "info" if log_path is not None else "warning"]
    if budget is not None:
        args += ["--max-num-batched-tokens", str(budget)]
    if not (own_defaults and policy.name == DEFAULT_SERVER_POLICY):
        args += policy.serve_args()
    for key, value in engine_overrides.items():
        if key == "enable_prefix_caching":
            args += [] if value else ["--no-prefix-caching"]
            continue
        if key == "enforce_eager":
            args += ["--enforce-eager"] if value else []
            continue
        if key not in _FLAGS:
            raise ValueError(f"engine setting {key!r} has no `sloserve serve` flag")
        if value is not None:
            args += [_FLAGS[key], str(value)]
    header = (f"sloserve serve: policy {policy.name}, "
              f"{'own defaults' if own_defaults else f'budget {budget}'}"
              f"{', ' + log_header if log_header else ''}")
    with launched_server(args, log_path=log_path,
                         log_header=header if log_path is not None else None,
                         startup_timeout_s=startup_timeout_s) as server:
        yield server.url
