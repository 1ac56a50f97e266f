"""The CPU decode pass (workers.graphs.cpu_decode_pass): a decode-only step through every layer in
one compiled call gives the layered path's hidden states and K/V bit for bit, in each dense
family it serves (biases, Qwen3's q/k norms, sliding windows, several decodes of different
contexts, one more than a group of four rows); its logits equal HF's; the engine runs its decode
steps on it with the same tokens as with it switched off; and models or steps it does not
serve run layer by layer."""

from __future__ import annotations

import logging
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import cpu_decode_pass as pass_kernel  # noqa: E402
from tests.utils.paged_helpers import (PagedSequence, build_metadata,  # noqa: E402
                                       make_kv_caches, paged_step)
from tests.utils.tiny_models import (load_tiny_model, make_bf16_valued_model,  # noqa: E402
                                     make_tiny_model)
from workers.graphs import cpu_decode_pass  # noqa: E402
from workers.layers import cpu_bf16_weights  # noqa: E402

# The fused CPU loops serve models from 256 hidden units (kernels.cpu_fused.MIN_HIDDEN_SIZE).
SMALL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512)
WINDOW = 24
FAMILIES = {
    "llama": ("llama", {}),
    "llama with biases": ("llama", {"tie_word_embeddings": False, "attention_bias": True,
                                    "mlp_bias": True}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 64}),
    "mistral sliding": ("mistral", {"sliding_window": WINDOW}),
}


@pytest.fixture(autouse=True, scope="module")
def compiled() -> None:
    if not pass_kernel.warm_up():
        pytest.skip("the CPU decode pass cannot be compiled here (no C++ compiler?)")


def _bf16_valued_model(path: Path, arch: str, **overrides) -> str:
    return make_bf16_valued_model(path, arch, seed=0, **{**SMALL, **overrides})


def _model_with_copies(model_dir: str) -> torch.nn.Module:
    model = load_tiny_model(model_dir)
    assert cpu_bf16_weights.hold_weights_in_bf16(model) > 0
    return model


def _sequences(lengths: list[int], block_size: int = 16) -> list[PagedSequence]:
    """Sequences of these many tokens over interleaved blocks (no two in a row in order)."""
    g = torch.Generator().manual_seed(3)
    sequences, next_block = [], 1
    for n in lengths:
        num_blocks = -(-n // block_size)
        blocks = [next_block + 2 * i for i in range(num_blocks)][::-1]
        next_block += 2 * num_blocks + 1
        sequences.append(PagedSequence(torch.randint(0, 512, (n,), generator=g).tolist(),
                                       blocks))
    return sequences


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_pass_equals_the_layered_forward_bit_for_bit(tmp_path, monkeypatch, family) -> None:
    monkeypatch.setenv(cpu_bf16_weights.BF16_ENV, "1")
    arch, overrides = FAMILIES[family]
    model = _model_with_copies(_bf16_valued_model(tmp_path, arch, **overrides))
    plan = cpu_decode_pass.plan_decode_pass(model)
    assert plan is not None and plan.max_rows == cpu_bf16_weights.FORCED_MAX_ROWS
    if family == "mistral sliding":
        assert set(model.layer_windows) == {WINDOW}  # probe: these layers slide
    # Five decodes (a second group of rows in the projections) whose contexts end in different
    # blocks, the longest past the window; their prompts are prefilled layer by layer first.
    sequences = _sequences([5, 17, 33, 40, 70])
    layered_caches = make_kv_caches(model, 64, 16)
    for seq in sequences:
        paged_step(model, layered_caches, [(seq, len(seq.tokens) - 1)], num_decodes=0)
    pass_caches = [(k.clone(), v.clone()) for k, v in layered_caches]
    for rows in (1, 5):
        work = [(seq, 1) for seq in sequences[:rows]]
        meta, ids, positions = build_metadata(work, num_decodes=rows)
        layered = model(ids, positions, meta, layered_caches)
        meta, ids, positions = build_metadata(work, num_decodes=rows)
        assert plan.serves(rows, meta)
        ran = plan.run(ids, positions, meta, pass_caches)
        assert torch.equal(ran, layered)
        for (k, v), (pk, pv) in zip(layered_caches, pass_caches):
            assert torch.equal(k, pk) and torch.equal(v, pv)
    assert plan.steps_run == 2
    # Probe: the decodes wrote new K/V (the caches did not just stay equal).
    slot = sequences[0].slot(len(sequences[0].tokens) - 1)
    assert pass_caches[0][0].view(-1, model.num_kv_heads, model.head_dim)[slot].abs().sum() > 0


def test_the_pass_decodes_as_hf_does(tmp_path, monkeypatch) -> None:
    """A prompt prefilled layer by layer, then eight decodes through the pass: every decode's
    logits equal HF transformers' over the whole sequence."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv(cpu_bf16_weights.BF16_ENV, "1")
    model_dir = _bf16_valued_model(tmp_path, "qwen3", head_dim=64)
    model = _model_with_copies(model_dir)
    plan = cpu_decode_pass.plan_decode_pass(model)
    seq = _sequences([48])[0]
    caches = make_kv_caches(model, 64, 16)
    paged_step(model, caches, [(seq, 40)], num_decodes=0)
    decoded = []
    for _ in range(8):
        meta, ids, positions = build_metadata([(seq, 1)], num_decodes=1)
        decoded.append(model.compute_logits(plan.run(ids, positions, meta, caches))[0])
        seq.num_computed += 1
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        reference = hf(torch.tensor([seq.tokens])).logits[0, 40:48]
    torch.testing.assert_close(torch.stack(decoded), reference, atol=2e-4, rtol=0)


def test_the_engine_decodes_on_the_pass_and_the_switch_turns_it_off(tmp_path,
                                                                   monkeypatch) -> None:
    from engine import LLM, SamplingParams

    monkeypatch.setenv(cpu_bf16_weights.BF16_ENV, "1")
    model_dir = _bf16_valued_model(tmp_path, "llama")
    prompts = [{"prompt_token_ids": [5, 9, 200, 31, 7, 77]}, {"prompt_token_ids": [3] * 20},
               {"prompt_token_ids": list(range(40, 75))}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(cpu_decode_pass.DECODE_PASS_ENV, switch)
        llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=32, max_model_len=256)
        try:
            plan = llm.engine.executor.runner.decode_pass
            assert (plan is not None) == (switch == "1")
            before = plan.steps_run if plan is not None else 0
            outputs[switch] = [list(o.token_ids) for o in llm.generate(prompts, params)]
            if plan is not None:
                # Probe: the decode steps ran on the pass (7 after each batch's prefill step).
                assert plan.steps_run - before >= 7
        finally:
            llm.shutdown()
    assert outputs["1"] == outputs["0"]


def test_models_and_steps_it_does_not_serve_run_layer_by_layer(tmp_path, monkeypatch,
                                                               caplog) -> None:
    monkeypatch.setenv(cpu_bf16_weights.BF16_ENV, "1")
    caplog.set_level(logging.INFO, logger=cpu_decode_pass.__name__)
    # float32-valued weights: no bf16 copies, no pass.
    plain = load_tiny_model(make_tiny_model(tmp_path / "f32", "llama", seed=0, **SMALL))
    cpu_bf16_weights.hold_weights_in_bf16(plain)
    assert cpu_decode_pass.plan_decode_pass(plain) is None
    assert "without a bfloat16 weight copy" in caplog.text
    # Gemma's norms scale by 1 + w: not the pass's RMSNorm.
    gemma = _model_with_copies(_bf16_valued_model(tmp_path / "gemma", "gemma3"))
    assert cpu_decode_pass.plan_decode_pass(gemma) is None
    # The switch.
    model = _model_with_copies(_bf16_valued_model(tmp_path / "llama", "llama"))
    monkeypatch.setenv(cpu_decode_pass.DECODE_PASS_ENV, "0")
    assert cpu_decode_pass.plan_decode_pass(model) is None
    monkeypatch.setenv(cpu_decode_pass.DECODE_PASS_ENV, "1")
    plan = cpu_decode_pass.plan_decode_pass(model)
    assert plan is not None
    # A step with a prefill chunk, or more decodes than every copy serves, is not its.
    sequences = _sequences([20] * (plan.max_rows + 1))
    meta, ids, _ = build_metadata([(sequences[0], 1), (sequences[1], 5)], num_decodes=1)
    assert not plan.serves(ids.shape[0], meta)
    work = [(seq, 1) for seq in sequences]
    for seq in sequences:
        seq.num_computed = 19
    meta, ids, _ = build_metadata(work, num_decodes=len(work))
    assert not plan.serves(ids.shape[0], meta)
    meta, ids, _ = build_metadata(work[:-1], num_decodes=len(work) - 1)
    assert plan.serves(ids.shape[0], meta)
