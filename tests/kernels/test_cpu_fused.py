"""The CPU's fused kernels (kernels.cpu_fused) against the eager layers and the PyTorch attention
they replace, in a model against HF and under mid-forward preemption, and where the eager path
stays: models too small or not float32, the switch off, a compile that fails."""

from __future__ import annotations

import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from kernels import cpu_fused, select_backend, torch_attention  # noqa: E402
from tests.utils.attention_cases import MIXED, MIXED_DECODES, make_case, slots  # noqa: E402
from tests.utils.kernel_counts import KernelsRan  # noqa: E402
from tests.utils.mid_forward import check_urgent_arrival_unwinds_long_prefill  # noqa: E402
from tests.utils.paged_helpers import PagedSequence, assert_chunks_match_hf  # noqa: E402
from tests.utils.tiny_models import make_tiny_model  # noqa: E402
from workers.layers import RMSNorm, apply_rotary, silu_and_mul  # noqa: E402
from workers.models import build_model  # noqa: E402
from workers.startup.weight_loader import load_weights  # noqa: E402

ATOL = 2e-4  # as tests/worker/test_models.py: float32 summation-order noise is ~1e-5


@pytest.fixture(scope="module")
def compiled() -> None:
    if not cpu_fused.warm_up():
        pytest.skip("the fused CPU kernels cannot be compiled here (no C++ compiler?)")


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


def _norm(hidden: int, seed: int) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5, dtype=torch.float32, device="cpu")
    norm.weight.data.copy_(_randn(hidden, seed=seed))
    return norm


# 576: the default model's width (whole vector lanes); 40: a tail shorter than a lane. 64 rows
# are split across the OpenMP threads.
@pytest.mark.parametrize("rows, hidden", [(1, 576), (5, 40), (64, 576)])
def test_rms_norm_matches_the_eager_layer(compiled, rows: int, hidden: int) -> None:
    norm = _norm(hidden, seed=0)
    # x as a column slice of a wider tensor (a strided view, read in place).
    x = _randn(rows, hidden + 24, seed=1)[:, 8:8 + hidden]
    residual = _randn(rows, hidden, seed=2)
    out, summed = cpu_fused.rms_norm(x, norm.weight, norm.eps, residual)
    expected, expected_sum = norm(x, residual)
    assert torch.equal(summed, expected_sum)  # the add rounds once, as torch's
    # Only the row's sum of squares is added up in another order.
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cpu_fused.rms_norm(x, norm.weight, norm.eps), norm(x),
                               atol=1e-5, rtol=1e-5)
    assert out.is_contiguous() and summed.is_contiguous()


def test_rms_norm_per_head_on_a_strided_qkv_slice(compiled) -> None:
    """Qwen3's q/k norm: [T, H, head_dim] rows addressed through two strides."""
    qkv = _randn(7, 12 * 64, seed=3)
    q = qkv[:, :9 * 64].view(7, 9, 64)
    norm = _norm(64, seed=4)
    torch.testing.assert_close(cpu_fused.rms_norm(q, norm.weight, norm.eps), norm(q),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens, head_dim", [(1, 64), (3, 80), (40, 64)])
def test_rotary_equals_the_eager_op_bit_for_bit(compiled, tokens: int, head_dim: int) -> None:
    heads, kv_heads = 9, 3
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, seed=5)
    # q and k as one strided view of the qkv projection, cos/sin as the table's halves.
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(tokens, -1, head_dim)
    cos, sin = _randn(tokens, 1, head_dim, seed=6).chunk(2, dim=-1)
    got = cpu_fused.apply_rotary(qk, cos, sin)
    assert torch.equal(got, apply_rotary(qk, cos, sin))
    assert got.is_contiguous()


@pytest.mark.parametrize("rows, width", [(1, 1536), (2, 40), (48, 1536)])
def test_silu_and_mul_equals_the_eager_op(compiled, rows: int, width: int) -> None:
    x = _randn(rows, 2 * width + 16, seed=7)[:, :2 * width]  # a row-strided view
    assert torch.equal(cpu_fused.silu_and_mul(x), silu_and_mul(x))


def test_bad_inputs_raise_value_errors(compiled) -> None:
    norm = _norm(64, seed=0)
    with pytest.raises(ValueError, match="float32"):
        cpu_fused.rms_norm(torch.zeros(2, 64, dtype=torch.bfloat16), norm.weight, 1e-5)
    with pytest.raises(ValueError, match="float32"):
        cpu_fused.rms_norm(torch.zeros(2, 32), norm.weight, 1e-5)  # the weight does not fit
    with pytest.raises(ValueError, match="cos/sin"):
        cpu_fused.apply_rotary(torch.zeros(2, 3, 64), torch.zeros(2, 1, 16), torch.zeros(2, 1, 16))
    with pytest.raises(ValueError, match="2 \\* I"):
        cpu_fused.silu_and_mul(torch.zeros(2, 5))


@pytest.mark.parametrize("num_heads, num_kv_heads", [(3, 3), (9, 3), (8, 2), (10, 5)])
@pytest.mark.parametrize("head_dim", [32, 80, 128])
def test_decode_attention_matches_dense_attention(compiled, num_heads: int, num_kv_heads: int,
                                                  head_dim: int) -> None:
    """A mixed batch (decodes over contexts from 1 to 131 tokens, then prefill chunks), each
    query head group, a head width of whole vector chunks or with a masked tail."""
    case = make_case(MIXED, MIXED_DECODES, num_heads, num_kv_heads, head_dim, 16,
                     torch.float32, seed=0)
    out = cpu_fused.paged_attention(case.query, case.new_keys, case.new_values,
                                    case.key_cache, case.value_cache, case.meta, case.scale)
    torch.testing.assert_close(out.double(), case.dense_reference(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("parallel_slots", [0, 10**9], ids=["threads", "one-thread"])
def test_decode_attention_reads_no_hidden_slot(compiled, monkeypatch,
                                               parallel_slots: int) -> None:
    """Slots past a context (the rest of its last block, block 0 padding the tables) may hold
    NaN left by an earlier owner: none reaches the output; the same split across threads."""
    monkeypatch.setattr(cpu_fused, "PARALLEL_SLOTS", parallel_slots)
    calls = []
    kernel = cpu_fused._KERNELS["decode_attention"]
    monkeypatch.setitem(cpu_fused._KERNELS, "decode_attention",
                        lambda *args: calls.append(args[-4]) or kernel(*args))
    specs = [(2, 1), (40, 1), (20, 1), (5, 30)]
    case = make_case(specs, 3, 9, 3, 64, 16, torch.float32, seed=5)
    for req in case.requests:
        ctx = req.num_cached + req.num_new
        hidden = slots(req, range(ctx, len(req.blocks) * 16), 16)
        case.key_cache.view(-1, 3, 64)[hidden] = float("nan")
        case.value_cache.view(-1, 3, 64)[hidden] = float("nan")
    if all(0 not in r.blocks for r in case.requests):
        case.key_cache[0] = float("nan")
        case.value_cache[0] = float("nan")
    buffer = torch.full((case.query.shape[0] + 2, 9, 64), float("nan"))
    out = cpu_fused.paged_attention(case.query, case.new_keys, case.new_values, case.key_cache,
                                    case.value_cache, case.meta, case.scale,
                                    out=buffer[:case.query.shape[0]])
    torch.testing.assert_close(out.double(), case.dense_reference(), atol=1e-5, rtol=0)
    assert buffer[case.query.shape[0]:].isnan().all()
    assert calls == [int(parallel_slots == 0)]  # probe: the loop ran, split or not


def test_decode_attention_leaves_other_dtypes_to_the_pytorch_path(compiled, monkeypatch) -> None:
    monkeypatch.setitem(cpu_fused._KERNELS, "decode_attention",
                        lambda *args: pytest.fail("the loop took bfloat16"))
    case = make_case(MIXED, MIXED_DECODES, 9, 3, 64, 16, torch.bfloat16, seed=1)
    args = (case.query, case.new_keys, case.new_values, case.key_cache, case.value_cache,
            case.meta, case.scale)
    assert torch.equal(cpu_fused.paged_attention(*args), torch_attention.paged_attention(*args))


def _model(model_dir: str) -> torch.nn.Module:
    model = build_model(AutoConfig.from_pretrained(model_dir), torch.float32, torch.device("cpu"))
    load_weights(model, model_dir)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_model_on_the_fused_kernels_matches_hf(compiled, tmp_path, monkeypatch,
                                                 arch: str) -> None:
    """A tiny model let onto the kernels (qwen3: per-head q/k norms too): prefill, a chunk
    over a cached prefix and decodes equal HF's logits; the kernels really ran."""
    monkeypatch.setattr(cpu_fused, "MIN_HIDDEN_SIZE", 0)
    calls = {name: 0 for name in ("rms_norm", "rotary", "silu_and_mul", "decode_attention")}
    for name in calls:
        kernel = cpu_fused._KERNELS[name]

        def counted(*args, _kernel=kernel, _name=name):
            calls[_name] += 1
            return _kernel(*args)

        monkeypatch.setitem(cpu_fused._KERNELS, name, counted)
    model_dir = make_tiny_model(tmp_path, arch, seed=0)
    model = _model(model_dir)
    assert all(norm.fused is cpu_fused.rms_norm for norm in model.modules()
               if isinstance(norm, RMSNorm))
    assert model.kernels.paged_attention is cpu_fused.paged_attention
    seq = PagedSequence(torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1))
                        .tolist(), blocks=[3, 1, 0])
    assert_chunks_match_hf(model, model_dir, seq, [20, 18], decodes=2, num_blocks=8, atol=ATOL)
    layers = model.config.num_hidden_layers
    # Two norms a layer and the final one (qwen3: two per-head norms more), one rotary and one
    # SiLU·mul a layer, in each of the 4 passes.
    norms = 2 * layers + 1 + (2 * layers if arch == "qwen3" else 0)
    assert calls == {"rms_norm": 4 * norms, "rotary": 4 * layers * (2 if arch == "qwen3" else 1),
                     "silu_and_mul": 4 * layers, "decode_attention": 2 * layers}


def test_tiny_and_non_float32_models_keep_the_eager_layers(monkeypatch) -> None:
    """No compile is even attempted for them."""
    monkeypatch.setattr(cpu_fused, "warm_up", lambda: pytest.fail("compiled for a tiny model"))
    assert not cpu_fused.serves(torch.float32, cpu_fused.MIN_HIDDEN_SIZE - 1)
    assert not cpu_fused.serves(torch.bfloat16, 4096)
    backend = select_backend("cpu")
    assert backend.rms_norm is cpu_fused.rms_norm and backend.fused_for is cpu_fused.serves
    assert select_backend("cpu", fused_ops="off").rms_norm is None


def test_the_switch_keeps_the_eager_layers(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cpu_fused, "MIN_HIDDEN_SIZE", 0)
    monkeypatch.setattr(cpu_fused, "warm_up", lambda: pytest.fail("compiled with the switch off"))
    monkeypatch.setenv(cpu_fused.FUSED_ENV, "0")
    model = _model(make_tiny_model(tmp_path, "llama", seed=0))
    assert all(norm.fused is None for norm in model.modules() if isinstance(norm, RMSNorm))
    layer = model.model.layers[0]
    assert layer.self_attn.apply_rotary is apply_rotary
    assert layer.mlp.act_and_mul is silu_and_mul
    assert model.kernels.paged_attention is torch_attention.paged_attention


def test_a_failed_compile_falls_back_to_the_eager_layers_with_a_warning(tmp_path, monkeypatch,
                                                                         caplog) -> None:
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    monkeypatch.setattr(cpu_fused, "MIN_HIDDEN_SIZE", 0)
    monkeypatch.setattr(cpu_fused, "_KERNELS", {})  # nothing compiled yet in this process

    def no_compiler(*args, **kwargs):
        raise RuntimeError("g++: not found")

    monkeypatch.setattr(CppPythonBindingsCodeCache, "load_pybinding", no_compiler)
    with caplog.at_level(logging.WARNING, logger=cpu_fused.__name__):
        model = _model(make_tiny_model(tmp_path, "llama", seed=0))
    assert "CPU fused kernels unavailable (RuntimeError: g++: not found)" in caplog.text
    assert all(norm.fused is None for norm in model.modules() if isinstance(norm, RMSNorm))
    assert model.model.layers[0].mlp.act_and_mul is silu_and_mul
    assert model.kernels.paged_attention is torch_attention.paged_attention
    # Tried once per process: the next model does not try again.
    monkeypatch.setattr(CppPythonBindingsCodeCache, "load_pybinding",
                        lambda *a, **k: pytest.fail("compiled twice"))
    assert not cpu_fused.serves(torch.float32, 576)


@pytest.mark.timeout(300)
def test_mid_forward_preemption_on_the_fused_kernels(compiled, model, monkeypatch) -> None:
    """The attention op stays where a step stops: an urgent arrival unwinds a long prefill
    between two layers whose glue runs on the fused kernels, and every output equals an
    unpreempted run's (on the same kernels: equality with HF is checked above)."""
    monkeypatch.setattr(cpu_fused, "MIN_HIDDEN_SIZE", 0)
    ran = KernelsRan.install(monkeypatch)
    # No wall-clock checks: beside other tests a machine this small stretches any step.
    check_urgent_arrival_unwinds_long_prefill(model, "suspend", check_timing=False)
    assert ran.counts["rms_norm"] > 0 and ran.counts["silu_and_mul"] > 0
