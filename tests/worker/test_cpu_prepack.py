"""The CPU linear kernels (workers.layers.cpu_prepack): which weights are packed, which kernel a
step of so many rows runs, that the model still equals HF with either or both, and when nothing
is packed."""

from __future__ import annotations

import os
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from tests.utils.paged_helpers import PagedSequence, assert_chunks_match_hf  # noqa: E402
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
    # 28 tokens: a chunk over a cached prefix.
    assert_chunks_match_hf(model, model_dir, seq, [40, 28], decodes=2, num_blocks=16, atol=ATOL)


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


def test_the_kernel_is_chosen_by_the_two_ratios() -> None:
    """plain/packed time at one row over every weight, and at BATCH_ROWS per shape."""
    choose = cpu_prepack.choose_kernel
    # Plain does not win single rows (the AVX2 machine): packed, as before the measurement.
    assert choose((8, 8), 0.95, 0.5).kernel == cpu_prepack.PACKED
    assert choose((8, 8), 1.3, 2.0).kernel == cpu_prepack.PACKED
    # It does (the AVX-512 machine): both where packing wins batches (its gate/up, 1.4-1.6)...
    both = choose((3072, 576), 0.74, 1.5)
    assert (both.kernel, both.packed_min_rows) == (cpu_prepack.BOTH,
                                                   cpu_prepack.PACKED_MIN_ROWS)
    # ...plain only where it does not, by the margin (q/k/v 1.00-1.10, o and down below 1).
    assert choose((960, 576), 0.74, 1.10).kernel == cpu_prepack.PLAIN
    assert choose((576, 576), 0.74, 0.95).kernel == cpu_prepack.PLAIN
    assert "from 3 rows" in both.describe(30, 212_000_000)


def _measured_model(model_dir: str, monkeypatch: pytest.MonkeyPatch, one_row: float,
                    batch: dict[tuple[int, int], float]) -> torch.nn.Module:
    """The model with its kernels chosen from these ratios, as if measured."""
    monkeypatch.setattr(cpu_prepack, "MIN_TUNED_ELEMENTS", 0)
    monkeypatch.setattr(cpu_prepack, "_time_kernels", lambda modules, packed: (one_row, {
        tuple(m.weight.shape): batch[tuple(m.weight.shape)] for m in modules}, 1.0))
    return _model(model_dir, prepack=True)


def test_the_row_count_picks_the_kernel_that_runs(tmp_path, monkeypatch) -> None:
    model_dir = make_tiny_model(tmp_path, "llama", seed=0)
    config = AutoConfig.from_pretrained(model_dir)
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    # Packing wins batches for gate/up and the (tied) LM head only.
    batch = {(q + 2 * kv, hidden): 1.0, (hidden, q): 0.9, (2 * inter, hidden): 1.5,
             (hidden, inter): 1.0, (config.vocab_size, hidden): 2.0}
    model = _measured_model(model_dir, monkeypatch, 0.75, batch)
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert [m.linear_kernel for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                      mlp.down_proj, model.lm_head)] == \
        ["plain", "plain", "both", "plain", "both"]
    assert not attn.qkv_proj.weight.is_mkldnn and attn.qkv_proj.packed_weight is None
    assert mlp.gate_up_proj.packed_min_rows == 3 and mlp.gate_up_proj.packed_weight.is_mkldnn
    # The tied head keeps multiplying by the embedding's own weight below 3 rows: no copy.
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.packed_weight.is_mkldnn

    ran: list[tuple[str, tuple[int, int]]] = []
    for name in ("_mkl_linear", "_onednn_linear"):
        inner = getattr(cpu_prepack, name)

        def recorded(x, weight, bias, _inner=inner, _name=name):
            ran.append((_name, tuple(x.shape)))
            return _inner(x, weight, bias)

        monkeypatch.setattr(cpu_prepack, name, recorded)
    for rows, kernel in ((1, "_mkl_linear"), (2, "_mkl_linear"), (3, "_onednn_linear"),
                         (8, "_onednn_linear")):
        ran.clear()
        mlp.gate_up_proj(torch.randn(rows, hidden))
        model.compute_logits(torch.randn(rows, hidden))
        attn.qkv_proj(torch.randn(rows, hidden))
        assert ran == [(kernel, (rows, hidden))] * 2 + [("_mkl_linear", (rows, hidden))]

    # Mixed kernels, HF's logits all the same: a prefill and a chunk (packed gate/up), decodes
    # (plain gate/up and head).
    seq = PagedSequence(torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1))
                        .tolist(), blocks=[2, 0, 1])
    assert_chunks_match_hf(model, model_dir, seq, [30, 2], decodes=8, num_blocks=8, atol=ATOL)


def test_where_plain_loses_single_rows_every_weight_is_packed(tmp_path, monkeypatch) -> None:
    model_dir = make_tiny_model(tmp_path, "llama", seed=0)
    config = AutoConfig.from_pretrained(model_dir)
    model = _measured_model(model_dir, monkeypatch, 1.3, defaultdict(lambda: 2.0))
    packed = [m for m in model.modules() if getattr(m, "prepack_weight", False)]
    assert all(m.linear_kernel == "packed" and m.weight.is_mkldnn for m in packed)
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # the head's copy
    assert len(packed) == 4 * config.num_hidden_layers + 1


def test_the_measurement_runs_on_the_models_weights(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cpu_prepack, "MIN_TUNED_ELEMENTS", 0)
    timed, measured = [], []
    time_kernels, measure = cpu_prepack._time_kernels, cpu_prepack._measure
    monkeypatch.setattr(cpu_prepack, "_time_kernels",
                        lambda *args: timed.append(time_kernels(*args)) or timed[-1])
    monkeypatch.setattr(cpu_prepack, "_measure",
                        lambda *args: measured.append(measure(*args)) or measured[-1])
    model = _model(make_tiny_model(tmp_path, "llama", seed=0, tie_word_embeddings=False),
                   prepack=True)
    modules = [m for m in model.modules() if getattr(m, "prepack_weight", False)]
    shapes = {tuple(m.weight.size()) for m in modules}
    assert 1 <= len(timed) <= cpu_prepack.TUNE_ATTEMPTS
    for one_row, batch, busy in timed:
        assert set(batch) == shapes and 0 < one_row < 100 and busy > 0
        assert all(0 < ratio < 100 for ratio in batch.values())
    # Each module got the kernel its shape's ratios choose.
    ((one_row, batch),) = measured
    for m in modules:
        shape = tuple(m.weight.size())
        assert m.linear_kernel == cpu_prepack.choose_kernel(shape, one_row, batch[shape]).kernel


def test_a_disturbed_or_tied_measurement_is_repeated(monkeypatch) -> None:
    """A busy machine reads as a tie (1.00): measured again, and the clearest answer kept."""
    def fake(results):
        left = list(results)
        monkeypatch.setattr(cpu_prepack, "_time_kernels", lambda *args: left.pop(0))
        return left

    quiet, busy = 1.1, 5.0
    left = fake([(0.75, {"a": 1.6}, quiet), (1.0, {}, busy)])
    assert cpu_prepack._measure([], {}) == (0.75, {"a": 1.6}) and len(left) == 1
    left = fake([(1.0, {"a": 1.0}, busy), (0.99, {"a": 1.0}, quiet), (0.78, {"a": 1.6}, quiet)])
    assert cpu_prepack._measure([], {}) == (0.78, {"a": 1.6}) and not left
    # Three disturbed measurements: the clearest of them.
    fake([(1.0, {"a": 1.0}, busy), (0.8, {"a": 1.5}, busy), (0.97, {"a": 1.1}, busy)])
    assert cpu_prepack._measure([], {}) == (0.8, {"a": 1.5})
    # An undisturbed tie is an answer too: packed, as on a machine where plain never wins.
    fake([(1.0, {"a": 0.9}, busy), (0.95, {"a": 2.0}, quiet), (1.0, {"a": 2.0}, busy)])
    assert cpu_prepack._measure([], {}) == (0.95, {"a": 2.0})


def test_the_switch_packs_every_weight_unmeasured(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cpu_prepack, "MIN_TUNED_ELEMENTS", 0)
    monkeypatch.setattr(cpu_prepack, "_time_kernels",
                        lambda *args: pytest.fail("measured with SLOSERVE_CPU_PREPACK=1"))
    monkeypatch.setenv(cpu_prepack.PREPACK_ENV, "1")
    model = _model(make_tiny_model(tmp_path, "llama", seed=0), prepack=True)
    packed = [m for m in model.modules() if getattr(m, "prepack_weight", False)]
    assert all(m.linear_kernel == "packed" and m.weight.is_mkldnn for m in packed)
