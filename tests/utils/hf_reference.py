"""HF transformers' greedy `generate`, the reference every engine output is compared with
(bench/hf_reference.py, shared with the GPU suite's equality checks)."""

from bench.hf_reference import hf_greedy  # noqa: F401
