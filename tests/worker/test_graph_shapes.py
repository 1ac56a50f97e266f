"""The decode batch sizes captured as CUDA graphs, the padded size a step replays at, and the
``--enforce-eager`` switch from the command line / ``LLM()`` to the model runner."""

from __future__ import annotations

import pytest

from engine.config import build_engine_config
from engine.entrypoints.cli import build_parser
from engine.entrypoints.engine_args import engine_kwargs
from engine.runtime.model_setup import resolve
from engine.executor.worker_config import worker_config
from engine.worker_messages import decode_config, encode
from workers.graphs.graph_shapes import MAX_CAPTURE_SIZE, capture_sizes, padded_batch_size


def test_capture_sizes_are_vllms_up_to_max_num_seqs() -> None:
    assert capture_sizes(128) == [1, 2, 4, *range(8, 129, 8)]
    assert capture_sizes(20) == [1, 2, 4, 8, 16]
    assert capture_sizes(3) == [1, 2]
    assert capture_sizes(1) == [1]
    # Never past vLLM's cap, however many sequences a step may hold.
    assert capture_sizes(4096)[-1] == MAX_CAPTURE_SIZE == 512
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        capture_sizes(0)


@pytest.mark.parametrize("decodes,padded", [
    (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (17, 24), (128, 128),
    (129, None), (0, None),
])
def test_a_decode_batch_replays_the_smallest_size_that_holds_it(decodes, padded) -> None:
    assert padded_batch_size(decodes, capture_sizes(128)) == padded


def test_no_captured_size_means_eager() -> None:
    assert padded_batch_size(1, []) is None


def _serve_args(*flags: str):
    return build_parser().parse_args(["serve", "--model", "/m", *flags])


def test_enforce_eager_is_off_unless_asked(tiny_model) -> None:
    assert engine_kwargs(_serve_args())["enforce_eager"] is False
    assert engine_kwargs(_serve_args("--enforce-eager"))["enforce_eager"] is True
    model = tiny_model("llama", num_hidden_layers=2)
    assert build_engine_config(model).model.enforce_eager is False
    config = build_engine_config(model, enforce_eager=True, device="cpu")  # LLM()'s kwargs
    assert config.model.enforce_eager is True
    # It reaches the TP workers' configuration, across the process boundary.
    sent = decode_config(encode(worker_config(config, resolve(config))))
    assert sent.engine.model.enforce_eager is True


def test_max_cudagraph_capture_size_caps_both_kinds_of_graph(tiny_model) -> None:
    assert engine_kwargs(_serve_args())["max_cudagraph_capture_size"] == 512
    kwargs = engine_kwargs(_serve_args("--max-cudagraph-capture-size", "16"))
    assert kwargs["max_cudagraph_capture_size"] == 16
    model = tiny_model("llama", num_hidden_layers=2)
    config = build_engine_config(model, max_cudagraph_capture_size=16, device="cpu")
    sent = decode_config(encode(worker_config(config, resolve(config))))
    assert sent.engine.model.max_cudagraph_capture_size == 16
    with pytest.raises(ValueError, match="max_cudagraph_capture_size must be >= 1, got 0"):
        build_engine_config(model, max_cudagraph_capture_size=0)
    # The engine's runner captures no decode batch and no step larger than the cap.
    from engine import LLM
    from workers.graphs.cuda_graphs import FAKE_GRAPHS_ENV

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FAKE_GRAPHS_ENV, "1")
        llm = LLM(model=model, dtype="float32", device="cpu", max_num_seqs=32,
                  max_num_batched_tokens=64, max_cudagraph_capture_size=16)
    try:
        runner = llm.engine.executor.runner
        assert sorted(runner.graphs.graphs) == [1, 2, 4, 8, 16]
        assert sorted(runner.piecewise.graphs) == [1, 2, 4, 8, 16]
    finally:
        llm.shutdown()
