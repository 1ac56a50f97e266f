"""A small mixture of experts on this CPU: sloserve against HF transformers, side by side.

Builds (once, seeded) a checkpoint of Qwen3-MoE's layout at about 0.4B parameters
(``engine.benchmarks.inputs.random_checkpoints.SMALL_MOE``: 8 layers, 32 experts, 4 per token)
with the default model's tokenizer, then runs ``sloserve bench throughput`` on it: prefill and
decode tokens/s of the engine and of HF transformers in the same run. Arguments after the
folder option go to the throughput benchmark (``--dtype``, ``--concurrency``, ...).

    python -m bench.diagnostics.moe_cpu --dtype float32 --concurrency 1 --no-roofline
    python -m bench.diagnostics.moe_cpu --folder /tmp/small-moe --dtype bfloat16 --no-roofline
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.benchmarks.e2e.throughput import main as throughput
from engine.benchmarks.inputs.random_checkpoints import small_moe
from engine.entrypoints.default_model import default_model_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default=str(Path.home() / ".cache" / "sloserve" / "small-moe"),
                        help="where the checkpoint is (built there when missing)")
    args, rest = parser.parse_known_args(argv)
    folder = Path(args.folder)
    if not (folder / "config.json").exists():
        print(f"building the small MoE checkpoint in {folder}", file=sys.stderr)
        small_moe(folder, default_model_path())
    return throughput(["--model", str(folder), *rest])


if __name__ == "__main__":
    raise SystemExit(main())
