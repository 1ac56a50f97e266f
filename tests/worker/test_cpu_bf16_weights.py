"""Which CPU linear weights get a bfloat16 copy (workers.layers.cpu_bf16_weights): a model whose
weights are bfloat16 values multiplies its few-row steps by the copies and still equals HF; long
steps keep the float32 kernels; a "both" weight gives up its plain copy; float32-valued weights,
tiny models and the switch get none; the rows a shape is served up to follow its measurement."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from kernels import cpu_bf16_linear  # noqa: E402
from tests.utils.paged_helpers import PagedSequence, assert_chunks_match_hf  # noqa: E402
from tests.utils.tiny_models import make_bf16_valued_model, make_tiny_model  # noqa: E402
from workers.layers import cpu_bf16_weights, cpu_prepack  # noqa: E402
from workers.models import build_model  # noqa: E402
from workers.startup.weight_loader import load_weights  # noqa: E402

ATOL = 2e-4  # as tests/worker/test_models.py: float32 summation-order noise is ~1e-5



@pytest.fixture(autouse=True, scope="module")
def compiled() -> None:
    if not cpu_bf16_linear.warm_up():
        pytest.skip("the bfloat16-weight CPU kernel cannot be compiled here (no C++ compiler?)")


def _bf16_valued_model(path: Path, **overrides) -> str:
    """A tiny llama whose every weight is a bfloat16 value, stored in float32."""
    return make_bf16_valued_model(path, "llama", seed=0, **overrides)


def _model(model_dir: str, prepack: bool = False) -> torch.nn.Module:
    model = build_model(AutoConfig.from_pretrained(model_dir), torch.float32, torch.device("cpu"))
    load_weights(model, model_dir)
    if prepack:
        cpu_prepack.prepack_linear_weights(model)
    cpu_bf16_weights.hold_weights_in_bf16(model)
    return model


def _linear_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if getattr(m, "prepack_weight", False)]


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every multiplication by a bfloat16 copy from now on."""
    rows: list[int] = []
    inner = cpu_bf16_linear.linear

    def counted(x, weight, bias=None):
        rows.append(x.numel() // x.shape[-1])
        return inner(x, weight, bias)

    monkeypatch.setattr(cpu_bf16_linear, "linear", counted)
    return rows


@pytest.mark.parametrize("variant", [
    {},  # tied LM head
    {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True},
])
def test_a_bf16_valued_model_decodes_on_the_copies_and_matches_hf(tmp_path, monkeypatch,
                                                                  variant) -> None:
    monkeypatch.setenv(cpu_bf16_weights.BF16_ENV, "1")
    model_dir = _bf16_valued_model(tmp_path, **variant)
    model = _model(model_dir)
    modules = _linear_modules(model)
    # Probe: every projection and the LM head hold a copy, serving up to FORCED_MAX_ROWS rows.
    assert len(modules) == 4 * len(model.model.layers) + 1
    assert all(m.bf16_weight is not None and m.bf16_max_rows == cpu_bf16_weights.FORCED_MAX_ROWS
               for m in modules)
    rows = _count_calls(monkeypatch)
    seq = PagedSequence(torch.randint(0, 512, (60,), generator=torch.Generator().manual_seed(1))
                        .tolist(), blocks=[7, 2, 11, 4, 0])
    # A 40-token prefill and a 12-token chunk over it, then 8 decodes.
    assert_chunks_match_hf(model, model_dir, seq, [40, 12], decodes=8, num_blocks=16, atol=ATOL)
    per_step = 4 * len(model.model.layers) + 1
    # The 40-row prefill ran on the float32 weights; the chunk and every decode on the copies.
    assert rows == [12] * per_step + [1] * (8 * per_step)


def test_long_steps_and_float32_valued_weights_keep_float32(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(cpu_bf16_weights.BF16_ENV, "1")
    model = _model(make_tiny_model(tmp_path / "f32", "llama", seed=0))
    assert all(m.bf16_weight is None for m in _linear_modules(model))

    model = _model(_bf16_valued_model(tmp_path / "bf16"))
    rows = _count_calls(monkeypatch)
    hidden = model.config.hidden_size
    model.compute_logits(torch.randn(cpu_bf16_weights.FORCED_MAX_ROWS + 1, hidden))
    assert rows == []
    model.compute_logits(torch.randn(cpu_bf16_weights.FORCED_MAX_ROWS, hidden))
    assert rows == [cpu_bf16_weights.FORCED_MAX_ROWS]


def test_tiny_models_and_the_switch_get_no_copies(tmp_path, monkeypatch) -> None:
    model_dir = _bf16_valued_model(tmp_path)
    # auto: the tiny model's weights are below MIN_ELEMENTS, and nothing is measured.
    monkeypatch.setattr(cpu_bf16_weights, "_measure",
                        lambda *args: pytest.fail("measured a tiny model's weights"))
    assert all(m.bf16_weight is None for m in _linear_modules(_model(model_dir)))
    monkeypatch.setenv(cpu_bf16_weights.BF16_ENV, "0")
    assert not cpu_bf16_weights.bf16_weights_available("cpu", torch.float32)
    monkeypatch.setenv(cpu_bf16_weights.BF16_ENV, "auto")
    assert cpu_bf16_weights.bf16_weights_available("cpu", torch.float32)
    assert not cpu_bf16_weights.bf16_weights_available("cpu", torch.bfloat16)
    assert not cpu_bf16_weights.bf16_weights_available("cuda", torch.float32)


def test_a_both_weight_gives_up_its_plain_copy(tmp_path, monkeypatch) -> None:
    """cpu_prepack's "both" (plain below 3 rows, packed from there) with a copy serving the few
    rows: only the packed copy is kept, except a tied head's, which is the embedding's."""
    monkeypatch.setattr(cpu_prepack, "MIN_TUNED_ELEMENTS", 0)
    monkeypatch.setattr(cpu_prepack, "_time_kernels", lambda modules, packed: (0.75, {
        tuple(m.weight.shape): 2.0 for m in modules}, 1.0))
    monkeypatch.setenv(cpu_bf16_weights.BF16_ENV, "1")
    model_dir = _bf16_valued_model(tmp_path)
    model = _model(model_dir, prepack=True)
    for module in _linear_modules(model):
        assert module.linear_kernel == cpu_prepack.PACKED and module.packed_weight is None
        assert module.weight.is_mkldnn and module.bf16_weight is not None
    embedding = model.model.embed_tokens.weight
    assert not embedding.is_mkldnn and model.lm_head.weight is not embedding
    seq = PagedSequence(torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(2))
                        .tolist(), blocks=[2, 0, 1])
    assert_chunks_match_hf(model, model_dir, seq, [30, 2], decodes=8, num_blocks=8, atol=ATOL)


def test_the_rows_served_follow_the_measurement(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cpu_bf16_weights, "MIN_ELEMENTS", 0)
    measured: list[dict] = []
    measure = cpu_bf16_weights._measure
    monkeypatch.setattr(cpu_bf16_weights, "_measure",
                        lambda *args: measured.append(measure(*args)) or measured[-1])
    model = _model(_bf16_valued_model(tmp_path, tie_word_embeddings=False))
    ((max_rows, ratios),) = measured
    modules = _linear_modules(model)
    assert set(ratios) == {tuple(m.weight.shape) for m in modules}
    for module in modules:
        shape = tuple(module.weight.shape)
        assert [r for r, _ in ratios[shape]] == list(cpu_bf16_weights.LADDER_ROWS)
        assert all(0 < ratio < 100 for _, ratio in ratios[shape])
        assert max_rows[shape] == cpu_bf16_weights.rows_served(ratios[shape])
        assert (module.bf16_weight is not None) == (max_rows[shape] > 0)
        assert module.bf16_max_rows == max_rows[shape]


def test_rows_served_is_the_prefix_of_wins() -> None:
    served = cpu_bf16_weights.rows_served
    assert served([(1, 0.6), (8, 0.55), (16, 0.8), (32, 1.1)]) == 16
    # A win after a loss does not count (a disturbed measurement, not a crossover).
    assert served([(1, 0.6), (8, 0.95), (16, 0.5)]) == 1
    # Losing single rows: no copy at all.
    assert served([(1, 0.95), (8, 0.5)]) == 0
    assert served([(1, 0.5), (8, 0.5), (16, 0.5), (32, 0.5)]) == 32


def test_the_engine_serves_on_the_copies_and_the_switch_turns_them_off(tmp_path,
                                                                        monkeypatch) -> None:
    from engine import LLM, SamplingParams

    model_dir = _bf16_valued_model(tmp_path)
    prompts = [{"prompt_token_ids": [5, 9, 200, 31, 7, 77]}, {"prompt_token_ids": [3] * 20}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(cpu_bf16_weights.BF16_ENV, switch)
        llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=32, max_model_len=256)
        try:
            modules = _linear_modules(llm.engine.executor.runner.model)
            assert all((m.bf16_weight is not None) == (switch == "1") for m in modules)
            rows = _count_calls(monkeypatch)
            outputs[switch] = [list(o.token_ids) for o in llm.generate(prompts, params)]
            # Probe: the decodes ran on the copies (or, switched off, nothing did).
            assert (1 in rows or 2 in rows) == (switch == "1")
            monkeypatch.undo()
        finally:
            llm.shutdown()
    assert outputs["1"] == outputs["0"]
