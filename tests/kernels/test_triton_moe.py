"""The fused mixture-of-experts kernels (kernels/triton_moe.py) against HF's loop over experts.

float32 is held to 1e-5 (absolute and relative, outputs are O(1)): both sides compute true float32
products and differ only in the GEMMs' summation order, which over H, I <= 96 terms moves a
result by a few 1e-7 (measured: < 1e-6); a wrong expert, slot or weight moves it by O(0.1), and
TF32 products (Triton's default for float32 dots on a GPU) by about 1e-3, so both would fail.

16-bit results round where HF's layers round (gate/up, silu, product, down, weighted output), so
they differ from the reference only where a GEMM's float32 sum, taken in another order, lands on
the other side of a rounding boundary. Measured in the interpreter: bfloat16 bit for bit, float16
under 1% of the elements by an ulp or so. The tests allow 16-bit outputs torch's default bf16
closeness (1.6e-2 relative, plus 1e-2 absolute for values near zero) and require 97% of elements
(99% for bf16) to be bit-identical: rounding in float32 throughout, as a once-rounded kernel
would, changes far more (a probe checks it), and a routing bug changes nearly all.

The kernels run on the ``triton_device`` (tests/utils/triton_device.py): interpreted on the CPU, or
compiled on a GPU under TRITON_INTERPRET=0; the PyTorch references always run on the CPU.
"""

from __future__ import annotations

# Must come before the kernels are decorated (on import): it picks interpreted or compiled.
import tests.utils.triton_device  # noqa: F401,I001

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import variants  # noqa: E402
from tests.utils.host_sync import SYNCING_METHODS  # noqa: E402

# On a GPU, bench/suite/gpu_suite.sh's tests-triton-compiled step runs the tests marked gpu.
pytestmark = pytest.mark.gpu
from kernels import triton_moe  # noqa: E402


@dataclass(frozen=True)
class Case:
    tokens: int
    hidden: int
    inter: int
    experts: int
    top_k: int
    ids_dtype: torch.dtype = torch.int64
    # Only these experts are routed to (the others get no tokens); None: any expert.
    used: tuple[int, ...] | None = None
    # BLOCK_M forced (None: the wrapper's choice), to run the larger blocks on small shapes.
    block_m: int | None = None
    # hidden_states a row-strided view and w2 with a non-unit last stride.
    strided: bool = False

    def __str__(self) -> str:
        return (f"T{self.tokens}-H{self.hidden}-I{self.inter}-E{self.experts}-K{self.top_k}"
                f"{'-i32' if self.ids_dtype == torch.int32 else ''}"
                f"{'-some-experts' if self.used else ''}"
                f"{f'-bm{self.block_m}' if self.block_m else ''}"
                f"{'-strided' if self.strided else ''}")


CASES = [
    Case(1, 64, 32, 8, 2),  # decode
    Case(1, 96, 80, 64, 8, torch.int32),  # decode, K = 8 of 64 experts: most get nothing
    Case(13, 80, 48, 8, 1, torch.int32),  # K = 1, H and I not multiples of the tiles
    Case(24, 96, 80, 16, 2, strided=True),
    Case(17, 72, 40, 64, 8),
    # Four experts of 16 get every pair (about 20 each: two blocks of 16 per expert).
    Case(40, 80, 48, 16, 2, used=(0, 5, 6, 13)),
    Case(40, 96, 80, 8, 2, torch.int32, block_m=64),
    Case(24, 64, 40, 8, 2, block_m=32),
]


def _routing(case: Case, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """K distinct experts per token (as a router's top-k picks) and softmaxed float32 weights."""
    pool = torch.tensor(case.used) if case.used else torch.arange(case.experts)
    picks = torch.rand(case.tokens, len(pool), generator=g).argsort(dim=1)[:, :case.top_k]
    ids = pool[picks].to(case.ids_dtype)
    weights = torch.softmax(torch.randn(case.tokens, case.top_k, generator=g), dim=1)
    return weights, ids


def _inputs(case: Case, dtype: torch.dtype, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(case.tokens, case.hidden, generator=g).to(dtype)
    # Scaled so every projection's output is O(1), as in a trained model.
    w13 = (torch.randn(case.experts, 2 * case.inter, case.hidden, generator=g)
           / case.hidden ** 0.5).to(dtype)
    w2 = (torch.randn(case.experts, case.hidden, case.inter, generator=g)
          / case.inter ** 0.5).to(dtype)
    return (x, w13, w2, *_routing(case, g))


def _on_device(case: Case, device: torch.device, x: torch.Tensor, w13: torch.Tensor,
               w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not case.strided:
        return x.to(device), w13.to(device), w2.to(device)
    # x a column slice of a wider buffer; w2 stored [E, I, H] and viewed as [E, H, I].
    wide = torch.zeros(x.shape[0], x.shape[1] + 24, dtype=x.dtype, device=device)
    wide[:, 8:8 + x.shape[1]] = x.to(device)
    x_view = wide[:, 8:8 + x.shape[1]]
    w2_view = w2.transpose(1, 2).contiguous().to(device).transpose(1, 2)
    assert not x_view.is_contiguous() and w2_view.stride(2) != 1
    return x_view, w13.to(device), w2_view


def _assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        return
    torch.testing.assert_close(got.float(), expected.float(), rtol=1.6e-2, atol=1e-2)
    same = (got.view(torch.int16) == expected.view(torch.int16)).float().mean().item()
    assert same >= (0.99 if got.dtype == torch.bfloat16 else 0.97), same


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_fused_experts_matches_the_reference(case, dtype, triton_device):
    x, w13, w2, weights, ids = _inputs(case, dtype, seed=case.tokens * 131 + case.experts)
    expected = triton_moe.fused_experts_reference(x, w13, w2, weights, ids)
    x_on, w13_on, w2_on = _on_device(case, triton_device, x, w13, w2)
    before = [t.clone() for t in (x_on, w13_on, w2_on)]
    got = triton_moe._fused_experts(x_on, w13_on, w2_on, weights.to(triton_device),
                                    ids.to(triton_device), block_m=case.block_m)
    assert got.device == x_on.device and got.is_contiguous()
    _assert_close(got.cpu(), expected)
    # The inputs are only read.
    assert all(torch.equal(t, b) for t, b in zip((x_on, w13_on, w2_on), before))
    if case.used:
        # Probe: the case really leaves experts without tokens.
        assert len(torch.unique(ids)) < case.experts


def test_fused_experts_matches_the_reference_in_float16(triton_device):
    case = Case(40, 96, 80, 16, 2)
    x, w13, w2, weights, ids = _inputs(case, torch.float16, seed=5)
    got = triton_moe.fused_experts(*(t.to(triton_device) for t in (x, w13, w2, weights, ids)))
    _assert_close(got.cpu(), triton_moe.fused_experts_reference(x, w13, w2, weights, ids))


def test_the_bf16_bound_pins_where_the_kernel_rounds():
    # Probe for the 99% bit-identical bound: the experts computed in float32 from the same bf16
    # inputs and rounded once at the end miss the reference's values far more often.
    case = Case(40, 96, 80, 16, 2)
    x, w13, w2, weights, ids = _inputs(case, torch.bfloat16, seed=5)
    expected = triton_moe.fused_experts_reference(x, w13, w2, weights, ids)
    once = triton_moe.fused_experts_reference(x.float(), w13.float(), w2.float(), weights,
                                              ids).to(torch.bfloat16)
    same = (once.view(torch.int16) == expected.view(torch.int16)).float().mean().item()
    assert same < 0.9


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("tokens, top_k, experts, block_m, used", [
    (1, 1, 8, 16, None), (1, 8, 64, 16, None), (37, 2, 8, 16, None), (40, 8, 64, 16, None),
    (200, 2, 16, 64, None), (33, 2, 16, 32, (2, 9, 10)), (0, 2, 8, 16, None)])
def test_alignment_puts_each_pair_once_in_its_experts_padded_group(tokens, top_k, experts,
                                                                   block_m, used, ids_dtype,
                                                                   triton_device):
    g = torch.Generator().manual_seed(tokens * 7 + top_k)
    case = Case(tokens, 8, 8, experts, top_k, ids_dtype, used)
    _, ids = _routing(case, g)
    sorted_ids, block_expert, num_padded = (
        t.cpu() for t in triton_moe.moe_align_block_size(ids.to(triton_device), experts, block_m))
    pairs = tokens * top_k
    flat = ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=experts)
    size = triton_moe.padded_size(pairs, experts, block_m)
    assert sorted_ids.shape == (size,) and sorted_ids.dtype == torch.int32
    assert block_expert.shape == (size // block_m,) and block_expert.dtype == torch.int32
    # The static size bounds the worst case: every hit expert padded by block_m - 1.
    assert size % block_m == 0 and size >= pairs + int((counts > 0).sum()) * (block_m - 1)
    padded = ((counts + block_m - 1) // block_m * block_m)
    assert num_padded.tolist() == [int(padded.sum())]
    # Every pair exactly once; everything else (group tails, the unused tail) is the sentinel N.
    real = sorted_ids[sorted_ids != pairs]
    assert torch.equal(real.sort().values, torch.arange(pairs, dtype=torch.int32))
    assert (sorted_ids[int(padded.sum()):] == pairs).all()
    # Group by group, experts in increasing order: the group's blocks name its expert, its real
    # pairs come first, in pair order, all routed to it, and only padding follows.
    start = 0
    for expert in range(experts):
        group = sorted_ids[start:start + int(padded[expert])]
        n = int(counts[expert])
        assert (block_expert[start // block_m:(start + len(group)) // block_m] == expert).all()
        assert (flat[group[:n].long()] == expert).all()
        assert torch.equal(group[:n], group[:n].sort().values)
        assert (group[n:] == pairs).all()
        start += len(group)
    if used:
        # Probe: some experts had no pairs, hence no group at all.
        assert (counts == 0).any()


def _sync_spy(monkeypatch) -> list[str]:
    """Record every host read of a tensor value (Tensor.item/tolist/int()/...) from now on."""
    seen: list[str] = []
    for name in SYNCING_METHODS:
        original = getattr(torch.Tensor, name, None)
        if original is None:
            continue

        def patched(tensor, *args, _name=name, _original=original, **kwargs):
            seen.append(_name)
            return _original(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, patched)
    return seen


# Ops that read a value back to the host, or whose output shape depends on tensor values (on a
# GPU both wait for the device and cannot be captured in a CUDA graph).
_SYNCING_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
                "aten::_unique", "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim",
                "aten::bincount", "aten::repeat_interleave", "aten::is_nonzero", "aten::equal",
                "aten::index_put_", "aten::masked_scatter"}


def _host_ops(fn, *args) -> tuple[list[str], set[torch.device]]:
    """The aten ops fn runs and the devices of every tensor they return."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: list[str] = []
    devices: set[torch.device] = set()

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ops.append(func._schema.name)
            devices.update(t.device for t in (out if isinstance(out, (list, tuple)) else [out])
                           if isinstance(t, torch.Tensor))
            return out

    with Spy():
        fn(*args)
    return ops, devices


def test_fused_experts_makes_no_host_sync(triton_device, monkeypatch):
    case = Case(40, 96, 80, 16, 2)
    inputs = [t.to(triton_device) for t in _inputs(case, torch.bfloat16, seed=3)]
    launched: list[str] = []
    # Launches are recorded but not run: what is left is the host-side work (the alignment, the
    # allocations, the final sum).
    monkeypatch.setattr(variants, "_run",
                        lambda kernel, *args: launched.append(variants._name(kernel)))
    seen = _sync_spy(monkeypatch)
    ops, devices = _host_ops(triton_moe.fused_experts, *inputs)
    assert seen == []
    assert not set(ops) & _SYNCING_OPS, sorted(set(ops) & _SYNCING_OPS)
    # Nothing is copied off the device (on a GPU the tensors say cuda:0, the fixture cuda).
    assert {d.type for d in devices} == {triton_device.type}
    assert launched == ["_gate_up_silu_kernel", "_down_weighted_kernel"]
    # Probe: both spies catch the reference's reads of the hit experts.
    ops, _ = _host_ops(triton_moe.fused_experts_reference, *inputs)
    assert {"aten::_unique2", "aten::nonzero"} <= set(ops)
    assert "tolist" in seen


def test_shapes_and_launches_depend_only_on_input_shapes(triton_device, monkeypatch):
    case = Case(24, 64, 40, 16, 2)
    g = torch.Generator().manual_seed(21)
    x, w13, w2, weights, _ = _inputs(case, torch.float32, seed=21)
    # Two routings of the same shape: spread over every expert, and piled onto one expert per
    # slot (the fewest padded rows).
    spread = torch.stack([torch.randperm(case.experts, generator=g)[:2] for _ in range(24)])
    piled = torch.tensor([[3, 7]] * 24)
    records: list[list[tuple]] = []
    real_run = variants._run

    def record(kernel, grid, args, constants):
        records[-1].append((grid, tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor)
                                        else a for a in args), tuple(sorted(constants.items()))))
        real_run(kernel, grid, args, constants)

    monkeypatch.setattr(variants, "_run", record)
    paddings = []
    for routing in (spread, piled):
        records.append([])
        on = [t.to(triton_device) for t in (x, w13, w2, weights, routing)]
        got = triton_moe.fused_experts(*on)
        _assert_close(got.cpu(), triton_moe.fused_experts_reference(x, w13, w2, weights, routing))
        paddings.append(triton_moe.moe_align_block_size(on[-1], case.experts, 16)[2].item())
    # Same grids, same buffer shapes and dtypes, same scalar arguments and constexprs.
    assert len(records[0]) == 2 and records[0] == records[1]
    # Probe: the real padded counts differ (the kernels read them on the device).
    assert paddings[0] != paddings[1]


def test_fused_experts_makes_no_sync_on_cuda(triton_device):
    if triton_device.type != "cuda":
        pytest.skip("CUDA's sync debug mode needs a GPU (the CPU checks are the tests above)")
    case = Case(40, 96, 80, 16, 2)
    inputs = [t.to(triton_device) for t in _inputs(case, torch.bfloat16, seed=3)]
    triton_moe.fused_experts(*inputs)  # compiles outside the checked call
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        triton_moe.fused_experts(*inputs)
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def test_fused_experts_replays_in_a_cuda_graph(triton_device):
    if triton_device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    case = Case(24, 96, 80, 16, 2)
    x, w13, w2, weights, ids = _inputs(case, torch.bfloat16, seed=8)
    static = [t.to(triton_device) for t in (x, w13, w2, weights, ids)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        triton_moe.fused_experts(*static)  # warm-up (compiles) off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_moe.fused_experts(*static)
    # A new routing (more tokens on fewer experts) copied into the captured inputs.
    g = torch.Generator().manual_seed(9)
    new_weights, new_ids = _routing(Case(24, 96, 80, 16, 2, used=(1, 4, 5)), g)
    static[3].copy_(new_weights)
    static[4].copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    _assert_close(out.cpu(), triton_moe.fused_experts_reference(x, w13, w2, new_weights, new_ids))


def test_empty_batches_give_empty_outputs(triton_device):
    w13 = torch.zeros(8, 64, 64, device=triton_device)
    w2 = torch.zeros(8, 64, 32, device=triton_device)
    out = triton_moe.fused_experts(torch.zeros(0, 64, device=triton_device), w13, w2,
                                   torch.zeros(0, 2, device=triton_device),
                                   torch.zeros(0, 2, dtype=torch.int64, device=triton_device))
    assert out.shape == (0, 64)


def test_bad_inputs_raise_value_errors_naming_the_problem():
    # Every check fails before a launch, so these run wherever the tensors are.
    x, w13, w2 = torch.zeros(4, 64), torch.zeros(8, 64, 64), torch.zeros(8, 64, 32)
    weights, ids = torch.zeros(4, 2), torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="hidden_states must be"):
        triton_moe.fused_experts(torch.zeros(64), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="w13 must be"):
        triton_moe.fused_experts(x, torch.zeros(8, 64, 80), w2, weights, ids)
    with pytest.raises(ValueError, match="w2 must be"):
        triton_moe.fused_experts(x, w13, torch.zeros(8, 32, 64), weights, ids)
    with pytest.raises(ValueError, match="topk_ids must be"):
        triton_moe.fused_experts(x, w13, w2, weights, torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="topk_weights has shape"):
        triton_moe.fused_experts(x, w13, w2, torch.zeros(4, 1), ids)
    with pytest.raises(ValueError, match="int32 or int64"):
        triton_moe.fused_experts(x, w13, w2, weights, ids.float())
    with pytest.raises(ValueError, match="w2 dtype"):
        triton_moe.fused_experts(x, w13, w2.bfloat16(), weights, ids)
    with pytest.raises(ValueError, match="unsupported dtype"):
        triton_moe.fused_experts(x.double(), w13.double(), w2.double(), weights, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens, top_k, block_m", [(1, 2, None), (24, 4, 16), (24, 4, 32)])
def test_gpt_oss_experts_match_its_pytorch_path(tokens, top_k, block_m, dtype, triton_device):
    """gpt-oss's variant (biases on both projections, the clamped SwiGLU) against the layer's
    PyTorch path, which equals HF's loop: in float32 to 1e-5, in bf16 to bf16's closeness (the
    PyTorch path adds a token's K results in bf16 one by one, the kernel in float32 once)."""
    from workers.layers.moe.gpt_oss_experts import GptOssExperts

    experts_count, hidden, inter = 8, 64, 40
    g = torch.Generator().manual_seed(tokens * 7 + top_k)
    layer = GptOssExperts(experts_count, hidden, inter, alpha=1.702, limit=7.0, dtype=dtype,
                          device="cpu")
    # Projections of a few units, biases of one: some gates and ups pass the clamp at 7.
    for param, scale in ((layer.w13_weight, 4.0), (layer.w2_weight, 1.0), (layer.w13_bias, 1.0),
                         (layer.w2_bias, 1.0)):
        param.data = (torch.randn(param.shape, generator=g) * scale
                      / (param.shape[-1] ** 0.5 if param.dim() == 3 else 1.0)).to(dtype)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    case = Case(tokens, hidden, inter, experts_count, top_k)
    weights, ids = _routing(case, g)
    weights = weights.to(dtype)  # gpt-oss's router softmaxes in the model dtype
    expected = layer(x, weights, ids)
    gate_up = torch.einsum("th,enh->ten", x.float(), layer.w13_weight.float())
    assert (gate_up.abs() > 7.0).any()  # probe: the clamp is reached
    on = {name: t.to(triton_device) for name, t in layer.fused_options().items()
          if isinstance(t, torch.Tensor)}
    options = {**layer.fused_options(), **on}
    got = triton_moe._fused_experts(x.to(triton_device), layer.w13_weight.to(triton_device),
                                    layer.w2_weight.to(triton_device),
                                    weights.to(triton_device), ids.to(triton_device),
                                    block_m=block_m, **options).cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), expected.float(), rtol=1.6e-2, atol=2e-2)
    # Probe: the biases and the activation change the answer.
    plain = triton_moe._fused_experts(x.to(triton_device), layer.w13_weight.to(triton_device),
                                      layer.w2_weight.to(triton_device),
                                      weights.to(triton_device), ids.to(triton_device)).cpu()
    assert (plain.float() - expected.float()).abs().max() > 0.1


def test_bad_biases_and_activations_are_named():
    x, w13, w2, weights, ids = _inputs(Case(2, 16, 8, 4, 2), torch.float32, seed=1)
    with pytest.raises(ValueError, match=r"unknown activation 'gelu'"):
        triton_moe.fused_experts(x, w13, w2, weights, ids, activation="gelu")
    with pytest.raises(ValueError, match=r"w13_bias must be \[E, 16\], got shape \(4, 8\)"):
        triton_moe.fused_experts(x, w13, w2, weights, ids, w13_bias=torch.zeros(4, 8))
