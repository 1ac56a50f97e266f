"""oneDNN-prepacked linear weights on a CPU (workers.layers.cpu_prepack): which weights are packed,
that the packed model still equals HF, and when nothing is packed."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from tests.utils.paged_helpers import PagedSequence, make_kv_caches, paged_step  # noqa: E402
from tests.utils.tiny_models import make_tiny_model  # noqa: E402
from workers.layers import cpu_prepack  # noqa: E402
from workers.models import build_model  # noqa: E402
from workers.startup.weight_loader import load_weights  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_prepack.prepack_available("cpu", torch.float32),
                                reason="this PyTorch build has no oneDNN linear prepacking")

ATOL = 2e-4  # as tests/worker/test_models.py: float32 summation-order noise is ~1e-5


def _model(model_dir: str, prepack: bool) -> torch.nn.Module:
    model = build_model(AutoConfig.from_pretrained(model_dir), torch.float32, torch.device("cpu"))
    load_weights(model, model_dir)
    if prepack:
        cpu_prepack.prepack_linear_weights(model)
    return model


@pytest.mark.parametrize("variant", [
    {},  # tied LM head
    {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True},
])
def test_prepacked_model_matches_hf(tmp_path, variant) -> None:
    model_dir = make_tiny_model(tmp_path, "llama", seed=0, **variant)
    model = _model(model_dir, prepack=True)
    # Probe: every projection and the LM head really run on packed weights, and the embedding
    # still looks rows up in its plain tensor.
    inner = model.model
    packed = [m.weight for m in model.modules() if getattr(m, "prepack_weight", False)]
    assert len(packed) == 4 * len(inner.layers) + 1
    assert all(w.is_mkldnn for w in packed)
    assert not inner.embed_tokens.weight.is_mkldnn
    assert model.lm_head.weight is not inner.embed_tokens.weight

    seq = PagedSequence(torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(1))
                        .tolist(), blocks=[7, 2, 11, 4, 0])
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([seq.tokens])).logits[0]
    caches = make_kv_caches(model, 16, 16)
    paged_step(model, caches, [(seq, 40)], num_decodes=0)
    paged_step(model, caches, [(seq, 28)], num_decodes=0)  # a chunk over a cached prefix
    for _ in range(2):
        paged_step(model, caches, [(seq, 1)], num_decodes=1)
    torch.testing.assert_close(torch.stack(seq.logits), ref, atol=ATOL, rtol=0)


def test_packing_twice_is_a_no_op(tmp_path) -> None:
    model = _model(make_tiny_model(tmp_path, "llama", seed=0), prepack=True)
    assert cpu_prepack.prepack_linear_weights(model) == 0


def test_linear_matches_f_linear_for_plain_and_packed_weights() -> None:
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, cpu_prepack.PACK_ROWS_HINT)
    for rows in (0, 1, 5, 64):
        x = torch.randn(rows, 32, generator=g)
        expected = torch.nn.functional.linear(x, weight, bias)
        assert torch.equal(cpu_prepack.linear(x, weight, bias), expected)
        torch.testing.assert_close(cpu_prepack.linear(x, packed, bias), expected,
                                   atol=1e-5, rtol=1e-5)
    # A column slice of a wider tensor (as q/k/v views are) is read with its strides.
    wide = torch.randn(6, 80, generator=g)[:, 8:40]
    torch.testing.assert_close(cpu_prepack.linear(wide, packed, None),
                               torch.nn.functional.linear(wide, weight), atol=1e-5, rtol=1e-5)


def test_where_nothing_is_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_prepack.prepack_available("cpu", torch.float32)
    assert not cpu_prepack.prepack_available("cpu", torch.bfloat16)
    assert not cpu_prepack.prepack_available("cuda", torch.float32)
    monkeypatch.setenv(cpu_prepack.PREPACK_ENV, "0")
    assert not cpu_prepack.prepack_available("cpu", torch.float32)


def test_engine_runs_prepacked_and_the_switch_turns_it_off(tmp_path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import LLM, SamplingParams

    model_dir = make_tiny_model(tmp_path, "llama", seed=0)
    prompts = [{"prompt_token_ids": [5, 9, 200, 31, 7, 77]}, {"prompt_token_ids": [3] * 20}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(cpu_prepack.PREPACK_ENV, switch)
        llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=32, max_model_len=256)
        try:
            head = llm.engine.executor.runner.model.lm_head
            assert head.weight.is_mkldnn == (switch == "1")
            outputs[switch] = [list(o.token_ids) for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()
    assert outputs["1"] == outputs["0"]
