"""A 4-layer tiny-model EngineCore whose first step a stand-in vote unwinds at layer 2 (test
helper): the `engine` fixture (the conftest.py of each folder whose tests use it registers it),
its requests, and that first step."""

from __future__ import annotations

import pytest
import torch

from engine.config import build_engine_config
from engine.core.request import Request
from engine.runtime.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from tests.utils.paged_helpers import StopAt


NUM_LAYERS = 4


@pytest.fixture
def engine(tiny_model):
    model = tiny_model("llama", num_hidden_layers=NUM_LAYERS)
    core = EngineCore(build_engine_config(model, dtype="float32", num_kv_blocks=32,
                                          max_model_len=256, block_size=16,
                                          slo_preempt_min_tokens=16, slo_preempt_mode="suspend"))
    yield core
    core.shutdown()


def _request(req_id: str, n: int, seed: int) -> Request:
    prompt = torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return Request(request_id=req_id, prompt_token_ids=prompt,
                   sampling_params=SamplingParams(max_tokens=3, temperature=0.0,
                                                  ignore_eos=True))


def _suspend_first_step(engine: EngineCore) -> None:
    """Runs one step that the 'monitor' unwinds at layer 2: its prefill chunks stay suspended
    on the worker (no victim: the signal targets nothing, the step just re-runs later)."""
    runner = engine.executor.runner
    vote = runner.vote
    runner.vote = StopAt(2)
    try:
        assert engine.step() == []
    finally:
        runner.vote = vote
