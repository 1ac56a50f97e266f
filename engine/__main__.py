"""`python -m engine ...` and `torchrun ... -m engine ...`: the `sloserve` command line."""

import sys

from engine.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
