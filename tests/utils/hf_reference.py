"""HF transformers' greedy `generate`, the reference every engine output is compared with
(engine/benchmarks/hf_reference.py, shared with the GPU suite's equality checks)."""

from engine.benchmarks.hf_reference import hf_greedy  # noqa: F401
