"""The CPU decode kernel groups a step's decodes by context: one 4000-token decode
beside five 100-token ones used to pad every row to 4000 slots (20-30x the grouped time in bf16
on this CPU; bench/diagnostics/cpu_attention.py's decode_mixed). Grouped, each row's result still matches
the dense float64 reference, and the model runner hands the kernel the host lengths it needs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.core.scheduler_output import ScheduledRequest
from kernels import torch_attention
from kernels.torch_attention import decode_groups
from tests.utils.attention_cases import make_case
from workers.model_runner import ModelRunner
from workers.step_buffers import StepLimits
from tests.utils.runner_configs import runner_config


def test_decodes_are_grouped_within_twice_the_first_context():
    lens = [4000, 100, 90, 2100, 300, 120, 3999]
    groups = decode_groups(lens)
    assert sorted(r for g in groups for r in g) == list(range(len(lens)))
    for group in groups:
        contexts = [lens[r] for r in group]
        assert max(contexts) <= max(2 * min(contexts), 256)
    assert [[lens[r] for r in g] for g in groups] == [[90, 100, 120], [300], [2100, 3999, 4000]]
    assert decode_groups([64] * 8) == [list(range(8))]  # equal contexts: one group


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_decodes_match_the_reference(dtype):
    specs = [(3999, 1), (99, 1), (500, 1), (99, 1), (1200, 1), (40, 1)]
    case = make_case(specs, len(specs), 9, 3, 64, 16, dtype, num_blocks=400)
    lens = case.meta.decode_context_lens.tolist()
    grouped = dataclasses.replace(case.meta, decode_context_list=lens)
    padded = dataclasses.replace(case.meta, decode_context_list=None)
    run = lambda meta: torch_attention.paged_attention(  # noqa: E731
        case.query, case.new_keys, case.new_values, case.key_cache, case.value_cache, meta,
        case.scale)
    out, before = run(grouped), run(padded)
    assert len(grouped.derived["decode"]) == 4  # probe: grouped (40-99, 500, 1200, 3999)
    assert len(padded.derived["decode"]) == 1
    reference = case.dense_reference().to(out.dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, reference, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(out, before, rtol=tolerance, atol=tolerance)


def test_the_model_runner_passes_the_host_context_lengths(tiny_model):
    model = tiny_model("llama")
    runner = ModelRunner(runner_config(model, num_blocks=64, block_size=16,
                                       limits=StepLimits(128, 4, 256)), torch.device("cpu"))
    params = SamplingParams(temperature=0)
    requests = [ScheduledRequest(req_id=str(i), token_ids=[5], start_pos=start,
                                 block_ids=list(range(4 * i, 4 * i + 4)), sample=True,
                                 sampling_params=params)
                for i, start in enumerate([40, 7, 60])]
    meta = runner.prepare_inputs(requests).attn_meta
    assert meta.decode_context_list == [41, 8, 61]
    assert (meta.decode_max_context, meta.decode_min_context) == (61, 8)
