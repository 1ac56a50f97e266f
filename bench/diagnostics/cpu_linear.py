"""The CPU linear layers: MKL through ``F.linear`` against oneDNN-prepacked weights, side by side.

Times one forward pass's worth of linear layers of the model (every decoder layer's q/k/v, o,
gate/up and down with its own weight, so the weights stream from memory as in a real step, not
from cache) and the LM head, at several row counts: 1 and 16 rows are decode steps, 512 a prefill
chunk. The two kernels alternate within each repeat so machine noise hits both alike. Prints one
JSON object; the engine packs its float32 CPU weights (``workers.layers.cpu_prepack``) because of
these figures.

    python -m bench.diagnostics.cpu_linear
    python -m bench.diagnostics.cpu_linear --rows 1 16 64 512 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def _layer_weights(shape, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """[layer][projection] weights [N, K] as the engine holds them (q/k/v and gate/up merged)."""
    q, kv = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    sizes = [(q + 2 * kv, shape.hidden), (shape.hidden, q),
             (2 * shape.intermediate, shape.hidden), (shape.hidden, shape.intermediate)]
    g = torch.Generator().manual_seed(0)
    return [[torch.randn(n, k, generator=g).to(dtype) for n, k in sizes]
            for _ in range(shape.n_layers)]


def _time_pair(plain, packed, repeats: int) -> tuple[float, float]:
    plain(), packed()  # warm-up: oneDNN primitive caches, first-touch of outputs
    a, b = [], []
    for _ in range(repeats):
        for fn, times in ((plain, a), (packed, b)):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
    return statistics.median(a), statistics.median(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 512])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from engine.benchmarks.measure.roofline import ModelShape
    from engine.entrypoints.default_model import model_path_or_default
    from engine.runtime.model_setup import load_hf_config
    from workers.layers import cpu_prepack

    dtype = torch.float32
    if not cpu_prepack.prepack_available("cpu", dtype):
        raise SystemExit("this PyTorch build (or SLOSERVE_CPU_PREPACK=0) has no prepacking")
    shape = ModelShape.from_hf_config(load_hf_config(model_path_or_default(args.model)))
    layers = _layer_weights(shape, dtype)
    packed_layers = [[torch.ops.mkldnn._reorder_linear_weight(w, cpu_prepack.PACK_ROWS_HINT)
                      for w in ws] for ws in layers]
    head = torch.randn(shape.vocab, shape.hidden).to(dtype)
    packed_head = torch.ops.mkldnn._reorder_linear_weight(head, cpu_prepack.PACK_ROWS_HINT)
    weight_bytes = sum(w.numel() * w.element_size() for ws in layers for w in ws)

    results = []
    for rows in args.rows:
        inputs = [torch.randn(rows, w.shape[1]).to(dtype) for w in layers[0]]

        def plain() -> None:
            for ws in layers:
                for x, w in zip(inputs, ws):
                    F.linear(x, w)

        def packed() -> None:
            for ws in packed_layers:
                for x, w in zip(inputs, ws):
                    cpu_prepack.linear(x, w, None)

        layers_mkl, layers_onednn = _time_pair(plain, packed, args.repeats)
        h = torch.randn(rows, shape.hidden).to(dtype)
        head_mkl, head_onednn = _time_pair(lambda: F.linear(h, head),
                                           lambda: cpu_prepack.linear(h, packed_head, None),
                                           args.repeats)
        flops = 2 * rows * weight_bytes / 4
        results.append({
            "rows": rows,
            "layers_ms": {"mkl": 1e3 * layers_mkl, "onednn_prepacked": 1e3 * layers_onednn},
            "layers_gflops": {"mkl": flops / layers_mkl / 1e9,
                              "onednn_prepacked": flops / layers_onednn / 1e9},
            "layers_speedup": layers_mkl / layers_onednn,
            "lm_head_ms": {"mkl": 1e3 * head_mkl, "onednn_prepacked": 1e3 * head_onednn},
            "lm_head_speedup": head_mkl / head_onednn})
        print(f"{rows:4d} rows: layers {1e3 * layers_mkl:7.1f} -> {1e3 * layers_onednn:7.1f} ms, "
              f"LM head {1e3 * head_mkl:6.1f} -> {1e3 * head_onednn:6.1f} ms", file=sys.stderr)
    print(json.dumps({"dtype": "float32", "torch_threads": torch.get_num_threads(),
                      "layer_weight_mb": weight_bytes / 1e6, "pack_rows_hint":
                      cpu_prepack.PACK_ROWS_HINT, "results": results}, indent=1))


if __name__ == "__main__":
    main()
