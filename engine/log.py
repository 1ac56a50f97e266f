"""Server-side logging: one stderr handler for sloserve's own packages, in every process.

Modules log through ``logging.getLogger(__name__)``; the loggers of the top-level packages carry
the handler, so a message from ``engine.serving.api_server`` or ``monitor.monitor`` reaches the server's
log without configuring the root logger (which would also let every library's INFO chatter
through). They still propagate, so pytest's caplog sees them. Entry points call this (the CLI,
and the spawned EngineCore and worker processes); importing a module configures nothing.
"""

from __future__ import annotations

import logging
import os
import sys

PACKAGES = ("engine", "workers", "monitor", "kernels", "bench")
_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is emitted, not when the handler was made:
    a stream swapped in later (pytest's capture, a redirect) is closed by now."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def configure_logging(level: str | int | None = None) -> None:
    """Idempotent. ``level`` defaults to $SLOSERVE_LOG_LEVEL, else INFO."""
    level = level or os.environ.get("SLOSERVE_LOG_LEVEL", "INFO")
    if isinstance(level, str):
        # As --log-level takes it: any case (uvicorn's levels are lowercase).
        name = level.upper()
        if not isinstance(logging.getLevelName(name), int):
            raise ValueError(f"unknown log level {level!r} (SLOSERVE_LOG_LEVEL or --log-level): "
                             f"use one of debug, info, warning, error, critical")
        level = name
    handler = _StderrHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT))
    for name in PACKAGES:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        if not any(getattr(h, "_sloserve", False) for h in logger.handlers):
            handler._sloserve = True  # type: ignore[attr-defined]
            logger.addHandler(handler)
