"""sloserve's log handler follows sys.stderr: a stream captured earlier may be closed by now."""

import io
import logging
import sys

from engine.log import configure_logging


def test_records_go_to_the_stderr_of_the_moment(monkeypatch):
    configure_logging("INFO")
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    logging.getLogger("engine.test_log").info("to the first")
    first.close()  # what pytest does to a test's captured stream when the test ends
    monkeypatch.setattr(sys, "stderr", second)
    logging.getLogger("engine.test_log").info("to the second")
    assert "to the second" in second.getvalue()
    assert "Logging error" not in second.getvalue()


def test_the_level_is_taken_in_any_case_and_an_unknown_one_is_named(monkeypatch):
    """`SLOSERVE_LOG_LEVEL=debug` works as `--log-level debug` does; a level that is none is a
    clear error naming it (it was a bare ValueError from logging: Unknown level)."""
    import pytest

    monkeypatch.setenv("SLOSERVE_LOG_LEVEL", "debug")
    configure_logging()
    assert logging.getLogger("engine").level == logging.DEBUG
    monkeypatch.setenv("SLOSERVE_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        configure_logging()
    configure_logging("INFO")
    assert logging.getLogger("engine").level == logging.INFO


def test_serve_log_level_reaches_sloserve_and_the_processes_it_starts(monkeypatch, capsys):
    """`serve --log-level debug` sets sloserve's own loggers (the engine core's step lines), not
    only uvicorn's, and exports the level to the processes `serve` spawns; an unknown level is
    a usage error naming it, before anything starts."""
    import os

    import engine.entrypoints.cli as cli

    started = []
    monkeypatch.setattr(cli, "_serve", lambda args: started.append(args) or 0)
    monkeypatch.setenv("SLOSERVE_LOG_LEVEL", "info")
    try:
        assert cli.main(["serve", "--log-level", "debug"]) == 0
        assert started  # probe: the command ran
        assert os.environ["SLOSERVE_LOG_LEVEL"] == "debug"
        assert logging.getLogger("engine").level == logging.DEBUG
        assert cli.main(["serve", "--log-level", "loud"]) == 2
        assert "unknown log level 'loud'" in capsys.readouterr().err
        assert len(started) == 1
    finally:
        configure_logging("INFO")
