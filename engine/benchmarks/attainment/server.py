"""A `sloserve serve` subprocess per benchmark cell, so that the HTTP runner measures each policy
on a fresh server (no prefix-cache hits carried over from the previous run).

`serve(..., log_path=PATH)` appends the server's log (info level) to PATH as the server writes
it, after a header line naming the cell, so the output folder keeps what each server did even
when the benchmark is killed; without a path the log is a temporary file at warning level,
quoted only when the server fails to start."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine.benchmarks.attainment.policies import PolicySpec
from engine.benchmarks.server import launched_server

# Engine overrides that map onto `sloserve serve` flags.
_FLAGS = {"dtype": "--dtype", "num_kv_blocks": "--num-kv-blocks",
          "max_model_len": "--max-model-len", "ttft_model": "--ttft-model",
          "slo_preempt_min_tokens": "--slo-preempt-min-tokens", "simulate": "--simulate",
          "device": "--device", "load_format": "--load-format"}


@contextmanager
def serve(policy: PolicySpec, budget: int, model: str, startup_timeout_s: float = 300.0,
          log_path: str | Path | None = None, log_header: str = "",
          **engine_overrides: Any) -> Iterator[str]:
    """Yields the base URL of a server running `policy` at `budget`; stops it afterwards. With
    `log_path`, the server's info-level log is appended there (after `log_header`'s line)."""
    args = ["--model", model, "--max-num-batched-tokens", str(budget),
            "--log-level", "info" if log_path is not None else "warning",
            *policy.serve_args()]
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
    header = (f"sloserve serve: policy {policy.name}, budget {budget}"
              f"{', ' + log_header if log_header else ''}")
    with launched_server(args, log_path=log_path,
                         log_header=header if log_path is not None else None,
                         startup_timeout_s=startup_timeout_s) as server:
        yield server.url
