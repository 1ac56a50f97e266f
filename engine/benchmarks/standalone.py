"""A standing benchmark run as its own program (`python bench/e2e/throughput.py ...`,
`python -m bench.e2e.soak ...`): the parser and the run of its `sloserve bench` subcommand, so
both spellings take the same options and do the same thing."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def standalone_main(description: str | None,
                    add_arguments: Callable[[argparse.ArgumentParser], None],
                    run: Callable[[argparse.Namespace], int],
                    argv: list[str] | None = None) -> int:
    """Parse `argv` (default: the command line) with the subcommand's arguments and run it;
    returns its exit status."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
