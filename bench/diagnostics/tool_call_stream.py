"""What streaming a tool call costs the API server's event loop: the reads of a call's settled
arguments over a whole stream (engine/serving/tool_calls/partial_json.py), read on from the last
update (`ArgumentReaders`, what the server does) against read afresh at each update (what it did
before), side by side in one run, for three shapes of arguments: one long string, many small
fields, a list of objects.

Each update is a few characters more of a hermes call (`<tool_call>{"name": ..., "arguments":
...`), parsed as a stream parses it. The loop also writes every other stream's chunks, so its
time per update is what every stream's first chunk waits behind. Prints a table, then one JSON
object (``--output`` also writes it). The figures are the script's to print, never a test's to
assert.

    python -m bench.diagnostics.tool_call_stream                # 5 KB of arguments
    python -m bench.diagnostics.tool_call_stream --kilobytes 20 --chars-per-update 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from engine.serving.tool_calls.parsers import HermesParser


def shapes(kilobytes: float) -> dict[str, dict[str, Any]]:
    """Arguments of about `kilobytes` KB each, in three shapes."""
    size = int(kilobytes * 1024)
    line = "def f(x):\n    return x * 2  # a comment, café\n"
    fields = size // 21
    rows = size // 42
    return {
        "one long string": {"path": "a.py", "content": line * max(1, size // len(line))},
        "many small fields": {f"field_{i}": i * 1.5 if i % 3 else f"value {i}"
                              for i in range(fields)},
        "list of objects": {"rows": [{"id": i, "name": f"row {i}", "ok": i % 2 == 0}
                                     for i in range(rows)]},
    }


def stream_reads(text: str, chars_per_update: int, resumed: bool) -> tuple[float, float, str]:
    """Seconds for all the stream's updates, for the last one, and the last settled arguments:
    resumed, one parser for the stream (as the server parses); else a new parser per update,
    which keeps nothing from the last."""
    stream_parser = HermesParser()
    cuts = [*range(chars_per_update, len(text), chars_per_update), len(text)]
    total = last = 0.0
    settled = ""
    for cut in cuts:
        start = time.perf_counter()
        parser = stream_parser if resumed else HermesParser()
        settled = parser.parse(text[:cut], False).opening_arguments
        last = time.perf_counter() - start
        total += last
    return total, last, settled


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kilobytes", type=float, default=5.0,
                        help="the size of each call's arguments (default: 5)")
    parser.add_argument("--chars-per-update", type=int, default=4,
                        help="characters a stream update adds (a token's worth; default: 4)")
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)

    rows = []
    print("| arguments | bytes | updates | afresh: stream (ms) | last update (ms) "
          "| read on: stream (ms) | last update (ms) | afresh / read on |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, arguments in shapes(args.kilobytes).items():
        text = HermesParser.OPEN + json.dumps({"name": "write_file", "arguments": arguments},
                                              ensure_ascii=False)
        fresh_total, fresh_last, fresh = stream_reads(text, args.chars_per_update, False)
        resumed_total, resumed_last, resumed = stream_reads(text, args.chars_per_update, True)
        if fresh != resumed:
            print(f"{name}: the two reads disagree", file=sys.stderr)
            return 1
        size = len(json.dumps(arguments, ensure_ascii=False))
        updates = -(-len(text) // args.chars_per_update)
        rows.append({"arguments": name, "bytes": size, "updates": updates,
                     "afresh_stream_ms": 1000 * fresh_total, "afresh_last_ms": 1000 * fresh_last,
                     "read_on_stream_ms": 1000 * resumed_total,
                     "read_on_last_ms": 1000 * resumed_last,
                     "ratio": fresh_total / resumed_total})
        print(f"| {name} | {size} | {updates} | {1000 * fresh_total:.1f} | "
              f"{1000 * fresh_last:.2f} | {1000 * resumed_total:.1f} | "
              f"{1000 * resumed_last:.3f} | {fresh_total / resumed_total:.0f}x |")
    result = {"kilobytes": args.kilobytes, "chars_per_update": args.chars_per_update,
              "rows": rows}
    print(json.dumps(result))
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
