"""The model runner's persistent input buffers (workers.step_buffers): every device input of a
step is a view of one of them, filled in place, and the buffers keep their addresses from step
to step (what a CUDA graph replays on) unless a step outgrows them."""

from __future__ import annotations

import pytest
import torch

from engine.core.scheduler_output import ScheduledRequest
from engine.sampling_params import SamplingParams
from workers.model_runner import ModelInputs, ModelRunner
from workers.step_buffers import StepBuffers, StepLimits
from tests.utils.runner_configs import runner_config

BLOCK = 16


@pytest.fixture(scope="module")
def runner(tiny_model) -> ModelRunner:
    model = tiny_model("llama", num_hidden_layers=2)
    return ModelRunner(runner_config(model, num_blocks=64, block_size=BLOCK,
                                     limits=StepLimits(max_num_tokens=128, max_num_seqs=4,
                                                       max_model_len=256)),
                       torch.device("cpu"))


def _request(req_id: str, start: int, n: int, first_block: int) -> ScheduledRequest:
    blocks = list(range(first_block, first_block + -(-(start + n) // BLOCK)))
    return ScheduledRequest(req_id=req_id, token_ids=list(range(3, 3 + n)), start_pos=start,
                            block_ids=blocks, sample=True,
                            sampling_params=SamplingParams(temperature=0))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _inputs_in_buffers(inputs: ModelInputs, buffers: StepBuffers) -> None:
    meta = inputs.attn_meta
    pairs = [(inputs.input_ids, buffers.input_ids), (inputs.positions, buffers.positions),
             (inputs.logits_indices, buffers.logits_indices),
             (meta.slot_mapping, buffers.slot_mapping),
             (meta.decode_block_tables, buffers.block_tables),
             (meta.decode_context_lens, buffers.context_lens),
             *[(t, buffers.block_tables) for t in meta.prefill_block_tables]]
    for view, buffer in pairs:
        assert _storage(view) == _storage(buffer)


def test_every_input_is_a_view_of_a_buffer_that_keeps_its_address(runner) -> None:
    buffers = runner.buffers
    # Sized from the limits: the largest step, max_model_len's blocks per table.
    assert buffers.input_ids.shape == (128,) and buffers.block_tables.shape == (5, 16)
    addresses = {name: _storage(getattr(buffers, name))
                 for name in (*StepBuffers.TOKEN_BUFFERS, *StepBuffers.SEQ_BUFFERS,
                              "block_tables")}
    mixed = [_request("d0", 20, 1, 0), _request("d1", 40, 1, 4), _request("p", 16, 30, 8)]
    inputs = runner.prepare_inputs(mixed)
    _inputs_in_buffers(inputs, buffers)
    meta = inputs.attn_meta
    assert inputs.input_ids.tolist() == [3, 3, *range(3, 33)]
    assert inputs.positions.tolist() == [20, 40, *range(16, 46)]
    assert meta.decode_context_lens.tolist() == [21, 41]
    assert (meta.decode_max_context, meta.decode_min_context) == (41, 21)
    assert meta.decode_block_tables.tolist() == [[0, 1, 0], [4, 5, 6]]
    assert [t.tolist() for t in meta.prefill_block_tables] == [[8, 9, 10]]
    assert meta.slot_mapping[:2].tolist() == [1 * BLOCK + 4, 6 * BLOCK + 8]
    assert inputs.logits_indices.tolist() == [0, 1, 31]

    # A second, smaller step overwrites the prefixes in place: same buffers.
    inputs = runner.prepare_inputs([_request("d1", 41, 1, 4)])
    _inputs_in_buffers(inputs, buffers)
    assert inputs.attn_meta.decode_block_tables.tolist() == [[4, 5, 6]]
    assert inputs.positions.tolist() == [41]
    assert addresses == {name: _storage(getattr(buffers, name)) for name in addresses}
    assert buffers.generation == 0


def test_a_step_larger_than_the_buffers_grows_them(runner) -> None:
    generation = runner.buffers.generation
    old = _storage(runner.buffers.input_ids)
    inputs = runner.prepare_inputs([_request("long", 0, 200, 16)])
    assert runner.buffers.generation == generation + 1  # what a captured graph checks
    assert _storage(runner.buffers.input_ids) != old
    _inputs_in_buffers(inputs, runner.buffers)
    assert inputs.positions.tolist() == list(range(200))


def test_upload_refuses_what_is_not_int64() -> None:
    buffers = StepBuffers(torch.device("cpu"), StepLimits(4, 1, 16), BLOCK)
    with pytest.raises(TypeError, match="int64"):
        buffers.upload(buffers.input_ids, torch.zeros(2, dtype=torch.int32))
