"""Figures written the moment they are measured: one JSON object a line, flushed at once.

A benchmark on a GPU machine held briefly runs under a hard time limit (`bench/suite/gpu_suite.sh` kills a step that
overruns it). Its final JSON is written at exit, so a killed step would lose every figure it had
measured; each figure, cell or trial also goes to a JSON-lines file as soon as it exists, so the
summary (bench/suite/gpu_summary.py) can still report what a killed step measured.

    log = FigureLog(jsonl_twin("OUT/throughput.json"))   # OUT/throughput.jsonl
    log.write("decode", side="engine", batch=1, tpot_ms=7.2)
    # -> {"kind": "decode", "side": "engine", "batch": 1, "tpot_ms": 7.2}

Every record has a `kind`; the rest of its fields are the bench's own. The file is started
afresh when opened (it is the twin of a JSON that is rewritten on each run, and two runs' lines
in one file could not be told apart). Lines are flushed, not fsynced: a killed process's
flushed writes are in the kernel already; only a machine crash could lose them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, TextIO


def jsonl_twin(path: str | Path) -> Path:
    """The JSON-lines file beside a JSON report: `throughput.json` -> `throughput.jsonl`."""
    return Path(path).with_suffix(".jsonl")


def print_result(result: dict[str, Any], output: str | Path | None) -> None:
    """A benchmark's one JSON object at the end: on stdout, and with `--output PATH` in that file
    too (the same text), so a caller need not capture stdout to keep it."""
    text = json.dumps(result, indent=2)
    print(text)
    if output:
        Path(output).write_text(text + "\n")


def plain(value: Any) -> Any:
    """A JSON-safe copy: NaN and infinities become None (standard JSON has neither), numpy
    scalars and tensors' items become numbers, dataclasses dicts, paths strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value))
    if hasattr(value, "item") and callable(value.item):  # numpy or torch scalar
        try:
            return plain(value.item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


class FigureLog:
    """Appends `{"kind": ..., **fields}` lines to `path` and flushes each; with `path` None it
    writes nothing, so a bench calls `write` whether or not it was asked for the file."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = None if path is None else Path(path)
        self._file: TextIO | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("w")

    def write(self, kind: str, **fields: Any) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(plain({"kind": kind, **fields})) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> FigureLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_figures(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file ([] when there is none). A last line cut short (the
    process killed mid-write) is left out, not an error: the lines before it are whole."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
