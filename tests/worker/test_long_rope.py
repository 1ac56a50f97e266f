"""LongRoPE (Phi-3's long-context checkpoints, Phi-4-mini) served as HF transformers computes
it: the short factors while a sequence is at most original_max_position_embeddings long, the
long factors for every token once it is longer, and a sequence that grows past the threshold
computed again from its first token (HF's Phi-3 drops its cache there); the prefix cache keeps
the two regimes' KV apart; factor lists of the wrong length are a clear startup error."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from engine.config import CacheConfig, SchedulerConfig  # noqa: E402
from engine.core.kv_cache_manager import ROOT_HASH, hash_block_tokens  # noqa: E402
from engine.core.long_rope import LONG_ROPE_ROOT_HASH, long_rope_threshold  # noqa: E402
from engine.core.request import Request, RequestStatus  # noqa: E402
from engine.core.scheduler import Scheduler  # noqa: E402
from engine.core.scheduler_output import ModelRunnerOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from tests.utils.tiny_models import make_tiny_config, make_tiny_model  # noqa: E402
from workers.layers.rotary import get_rotary_embedding  # noqa: E402

THRESHOLD = 32
# head_dim 16 with Phi-4-mini's partial rotary of 0.75: 12 rotary dims, 6 frequencies.
LONG_ROPE = dict(
    partial_rotary_factor=0.75, max_position_embeddings=256,
    original_max_position_embeddings=THRESHOLD,
    rope_scaling={"type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0],
                  "long_factor": [1.0, 3.0, 6.0, 12.0, 24.0, 48.0]})


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_table_holds_hfs_rows_of_both_regimes() -> None:
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = make_tiny_config("phi3", **LONG_ROPE)
    assert long_rope_threshold(config) == THRESHOLD
    ours = get_rotary_embedding(config, 16, dtype=torch.float32, device="cpu")
    assert ours.long_offset == THRESHOLD and ours.rotary_dim == 12
    hf = Phi3RotaryEmbedding(config)
    x = torch.zeros(1, 1, 16)
    for length in (THRESHOLD, THRESHOLD + 1, 200):  # short, then long (HF: by the length)
        positions = torch.arange(length)
        hf_cos, hf_sin = hf(x, positions[None])
        rows = positions + (ours.long_offset if length > THRESHOLD else 0)
        cos, sin = ours(rows)
        torch.testing.assert_close(cos[:, 0], hf_cos[0, :, :6], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin[:, 0], hf_sin[0, :, :6], rtol=0, atol=1e-6)
    # Probe: the regimes really differ, and the attention factor scales both.
    assert not torch.allclose(ours(torch.tensor([5]))[0], ours(torch.tensor([5 + THRESHOLD]))[0])


def _request(req_id: str, tokens: list[int], max_tokens: int = 64) -> Request:
    return Request(req_id, tokens, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                  ignore_eos=True))


def test_a_sequence_that_grows_past_the_threshold_is_computed_again_in_the_long_regime() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), CacheConfig(block_size=4),
                          num_blocks=64, max_model_len=128, long_rope_after=8)
    short, long = _request("short", list(range(6))), _request("long", list(range(10)))
    for request in (short, long):
        scheduler.add_request(request)
    # A prompt past the threshold runs long from its first token, its hashes from the long root.
    assert long.long_rope and not short.long_rope
    assert long.block_hashes[0] == hash_block_tokens(LONG_ROPE_ROOT_HASH, [0, 1, 2, 3])
    assert short.block_hashes[0] == hash_block_tokens(ROOT_HASH, [0, 1, 2, 3])
    crossed = False
    for _ in range(8):
        output = scheduler.schedule()
        sent = {r.req_id: r for r in output.requests}
        assert sent["long"].long_rope
        if "short" in sent:
            # Its sequence is at most 8 tokens while short; the step that recomputes it sends
            # every token, long, after the first block: the long request's block of the same
            # 4 tokens (its own short one chains from the other root).
            first = sent["short"]
            if not first.long_rope:
                assert first.start_pos + len(first.token_ids) <= 8
            elif not crossed:
                assert first.start_pos == 4 and len(first.token_ids) == 5
                crossed = True
        scheduler.update_from_output(output, ModelRunnerOutput(
            step_id=output.step_id,
            sampled_token_ids={r.req_id: 7 for r in output.requests if r.sample}))
    assert crossed and short.long_rope and short.status is RequestStatus.RUNNING
    assert short.block_hashes[0] == hash_block_tokens(LONG_ROPE_ROOT_HASH, [0, 1, 2, 3])
    scheduler.check_invariants()


@pytest.mark.parametrize("budget", [2048, 16], ids=["whole-prompts", "chunks-of-16"])
def test_the_engine_generates_as_hf_in_both_regimes_and_across_the_threshold(
        tmp_path, budget: int) -> None:
    from engine import LLM

    model_dir = make_tiny_model(tmp_path / "model", "phi3", seed=0, **LONG_ROPE)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # Short throughout; short then past the threshold (HF recomputes at 33 tokens); long from
    # the first token; and one sharing the first's 20 tokens as its prefix, but long.
    base = _tokens(20, seed=1)
    prompts = [_tokens(10, seed=0), base, _tokens(40, seed=2), base + _tokens(16, seed=3)]
    lengths = [12, 24, 12, 12]

    def hf_generate(model, prompt: list[int], n: int) -> list[int]:
        return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()

    expected = [hf_generate(hf, p, n) for p, n in zip(prompts, lengths)]
    # Probe: the long factors change what this model generates past the threshold.
    short_only = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, original_max_position_embeddings=1024,
        rope_scaling={**LONG_ROPE["rope_scaling"], "original_max_position_embeddings": 1024})
    assert hf_generate(short_only, prompts[1], 24) != expected[1]
    assert hf_generate(short_only, prompts[2], 12) != expected[2]

    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=64, max_model_len=256,
              max_num_batched_tokens=budget, block_size=4)
    try:
        outputs = [llm.generate([{"prompt_token_ids": p}],
                                SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
                   for p, n in zip(prompts, lengths)]
        stats = llm.engine.scheduler
        hits = stats.kv_cache_manager.prefix_cache_hits
    finally:
        llm.shutdown()
    assert [list(o.token_ids) for o in outputs] == expected
    # The second prompt's 20 tokens were cached short (and then long, once it crossed: 32 of
    # its 44 tokens in full blocks); the fourth, long from its first token, found the long ones.
    assert hits > 0


def test_factor_lists_of_the_wrong_length_are_a_startup_error(tmp_path) -> None:
    import json

    from engine.model_folder import load_hf_config

    config = make_tiny_config("phi3", **LONG_ROPE)
    saved = config.to_dict()
    saved["rope_parameters"]["long_factor"] = [1.0] * 8
    (tmp_path / "config.json").write_text(json.dumps(saved))
    # Where the engine reads a checkpoint's config, transformers names the field.
    with pytest.raises(Exception, match=r"long_factor field must have length 6, got 8"):
        load_hf_config(str(tmp_path))
    # A longrope config without the length its regimes switch at.
    no_threshold = make_tiny_config("llama")
    no_threshold.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0,
                                    "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    with pytest.raises(ValueError, match="longrope config needs original_max_position_emb"):
        get_rotary_embedding(no_threshold, 16, dtype=torch.float32, device="cpu")
    # A config built past that check meets the rotary table's own.
    config.rope_parameters = {**config.rope_parameters, "short_factor": [1.0] * 4}
    with pytest.raises(ValueError, match=r"longrope short_factor must list 6 factors .* got 4"):
        get_rotary_embedding(config, 16, dtype=torch.float32, device="cpu")
