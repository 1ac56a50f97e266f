"""Fused Triton RMSNorm, rotary and SiLU-and-mul kernels against the PyTorch layers, in Triton's
interpreter.

Rotary is elementwise, so it must match bit for bit in every dtype. RMSNorm matches bit for bit
whenever its row sum is exact (inputs on a coarse grid); on arbitrary inputs only the float32 sum
of squares may differ from torch's, whose summation order is its own (and depends on the CPU's
vector width), so there the tests allow float32 a few ulps and 16-bit outputs one ulp. SiLU-and-mul
is elementwise but calls ``exp``, whose last bit differs between libraries (torch's, numpy's in
the interpreter, libdevice's on a GPU), so it is held to the same bounds.

The kernels run on the ``triton_device`` (tests/utils/triton_device.py): interpreted on the CPU, or
compiled on a GPU under TRITON_INTERPRET=0; the PyTorch references always run on the CPU.
"""

from __future__ import annotations

# Must come before the kernels are decorated (on import): it picks interpreted or compiled.
import tests.utils.triton_device  # noqa: F401,I001

import pytest  # noqa: E402
import torch  # noqa: E402

from workers.layers.activation import silu_and_mul as reference_silu_and_mul  # noqa: E402
from workers.layers.norm import RMSNorm  # noqa: E402
from workers.layers.rotary import apply_rotary as reference_rotary  # noqa: E402

# On a GPU, bench/suite/gpu_suite.sh's tests-triton-compiled step runs the tests marked gpu.
pytestmark = pytest.mark.gpu
from kernels import triton_activation, triton_norm, triton_rotary  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place (same dtype, finite values)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    bits = a.element_size() * 8
    int_dtype = {32: torch.int32, 16: torch.int16}[bits]

    def ordered(t: torch.Tensor) -> torch.Tensor:
        # Sign-magnitude bit patterns to a number line where adjacent floats differ by one.
        i = t.contiguous().view(int_dtype).to(torch.int64)
        return torch.where(i < 0, -(i & ((1 << (bits - 1)) - 1)), i)

    return (ordered(a) - ordered(b)).abs()


def _on(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


def _norm(hidden: int, dtype: torch.dtype, g: torch.Generator) -> RMSNorm:
    norm = RMSNorm(hidden, EPS, dtype=dtype, device="cpu")
    # The layer can delegate to a fused kernel; the reference must be its PyTorch arithmetic.
    assert getattr(norm, "fused", None) is None
    # A non-trivial weight, so the final scale-and-round step is exercised.
    norm.weight.data = (1 + 0.25 * torch.randn(hidden, generator=g)).to(dtype)
    return norm


def _assert_norm_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        # A one-ulp difference in the variance moves the output by a few ulps; 1e-6 is ~8-16.
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    else:
        # Only values sitting on a rounding boundary can flip, and then by one ulp (seen: ~1 in
        # 20,000 for fp16, none for bf16); a rounding-step bug would flip far more.
        ulps = _ulps(got, expected)
        assert ulps.max().item() <= 1
        assert (ulps > 0).float().mean().item() < 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [80, 576, 960, 1024])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_is_bit_exact_when_the_row_sum_is_exact(dtype, hidden, with_residual,
                                                         triton_device):
    g = torch.Generator().manual_seed(hidden + 7 * with_residual)
    # Multiples of 1/4 in [-2, 2]: squares and their sums are exact in float32 in any order, so
    # every remaining step (divide, rsqrt, round to dtype, scale, round) must agree exactly.
    x = (torch.randint(-8, 9, (12, hidden), generator=g) / 4).to(dtype)
    norm = _norm(hidden, dtype, g)
    if with_residual:
        residual = (torch.randint(-8, 9, (12, hidden), generator=g) / 4).to(dtype)
        got, got_sum = triton_norm.rms_norm(*_on(triton_device, x, norm.weight), EPS,
                                            residual.to(triton_device))
        expected, expected_sum = norm(x, residual)
        assert torch.equal(got_sum.cpu(), expected_sum)
    else:
        got, expected = triton_norm.rms_norm(*_on(triton_device, x, norm.weight), EPS), norm(x)
    assert got.dtype == dtype and torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [80, 960, 2048])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_reference_on_random_inputs(dtype, hidden, with_residual,
                                                         triton_device):
    g = torch.Generator().manual_seed(100 + hidden + with_residual)
    x = (3 * torch.randn(16, hidden, generator=g)).to(dtype)
    x_on = x.to(triton_device)
    x_before = x_on.clone()
    norm = _norm(hidden, dtype, g)
    if with_residual:
        residual = (3 * torch.randn(16, hidden, generator=g)).to(dtype)
        got, got_sum = triton_norm.rms_norm(x_on, norm.weight.to(triton_device), EPS,
                                            residual.to(triton_device))
        expected, expected_sum = norm(x, residual)
        # The add is elementwise: rounded to the model dtype exactly as torch does.
        assert torch.equal(got_sum.cpu(), expected_sum)
    else:
        got, expected = triton_norm.rms_norm(x_on, norm.weight.to(triton_device), EPS), norm(x)
    _assert_norm_close(got.cpu(), expected)
    assert torch.equal(x_on, x_before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_per_head_on_a_strided_qkv_slice(dtype, triton_device):
    # Qwen3's q/k norm: [T, H, D] over the last dim, on a view into the fused qkv output.
    g = torch.Generator().manual_seed(3)
    num_tokens, num_heads, head_dim = 7, 4, 128
    qkv = torch.randn(num_tokens, (num_heads + 4) * head_dim, generator=g).to(dtype)
    qkv = qkv.to(triton_device)  # the view is taken on the device, as the model takes it
    k = qkv[:, num_heads * head_dim:(2 * num_heads) * head_dim].unflatten(-1, (num_heads, -1))
    assert not k.is_contiguous()
    qkv_before = qkv.clone()
    norm = _norm(head_dim, dtype, g)
    got = triton_norm.rms_norm(k, norm.weight.to(triton_device), EPS)
    _assert_norm_close(got.cpu(), norm(k.cpu()))
    assert torch.equal(qkv, qkv_before)


def test_rms_norm_promotes_a_float32_weight_like_torch(triton_device):
    g = torch.Generator().manual_seed(5)
    x = (torch.randint(-8, 9, (5, 96), generator=g) / 4).to(torch.bfloat16)
    weight = 1 + 0.25 * torch.randn(96, generator=g)
    x32 = x.float()
    expected = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    got = triton_norm.rms_norm(*_on(triton_device, x, weight), EPS)
    assert got.dtype == torch.float32 and torch.equal(got.cpu(), expected)


def _rotary_inputs(dtype: torch.dtype, head_dim: int, g: torch.Generator,
                   device: torch.device | str = "cpu"
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A strided [T, H, D] view into a wider qkv-like tensor (every other head, so both the token
    and the head strides differ from a packed tensor's), and cos/sin views of one table, all on
    ``device`` (the views taken there)."""
    num_tokens, num_heads, total_heads = 9, 3, 8
    big = (4 * torch.randn(num_tokens, total_heads, head_dim, generator=g)).to(dtype).to(device)
    x = big[:, 1:1 + 2 * num_heads:2]
    angles = 1000 * torch.rand(num_tokens, head_dim // 2, generator=g)
    table = torch.cat((angles.cos(), angles.sin()), -1).to(dtype).unsqueeze(1).to(device)
    cos, sin = table.chunk(2, dim=-1)
    return big, x, cos, sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_rotary_matches_the_reference_bit_for_bit(dtype, head_dim, triton_device):
    g = torch.Generator().manual_seed(head_dim)
    big, x, cos, sin = _rotary_inputs(dtype, head_dim, g, triton_device)
    assert not x.is_contiguous() and not cos.is_contiguous()
    big_before = big.clone()
    got = triton_rotary.apply_rotary(x, cos, sin).cpu()
    x, cos, sin = x.cpu(), cos.cpu(), sin.cpu()
    expected = reference_rotary(x, cos, sin)
    assert got.dtype == dtype and torch.equal(got, expected)
    assert torch.equal(big, big_before)
    if dtype != torch.float32:
        # Probe: rounding only once (fused products) differs from the reference, so the equality
        # above really pins down where the kernel rounds.
        half = head_dim // 2
        x1, x2, c, s = x[..., :half].float(), x[..., half:].float(), cos.float(), sin.float()
        once = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).to(dtype)
        assert not torch.equal(once, expected)


def test_rotary_copies_a_head_dim_with_non_unit_stride(triton_device):
    g = torch.Generator().manual_seed(11)
    _, _, cos, sin = _rotary_inputs(torch.bfloat16, 80, g, triton_device)
    # [T, D, H] transposed to [T, H, D]: the last stride is H, so the wrapper copies first.
    x = torch.randn(9, 80, 5, generator=g).to(torch.bfloat16).to(triton_device).transpose(1, 2)
    assert x.stride(-1) != 1
    got = triton_rotary.apply_rotary(x, cos, sin).cpu()
    assert torch.equal(got, reference_rotary(x.cpu(), cos.cpu(), sin.cpu()))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_conversions_round_like_torch_casts(dtype, triton_device):
    import triton
    import triton.language as tl

    @triton.jit
    def convert(narrow_ptr, wide_ptr, narrowed_ptr, widened_ptr, KIND: tl.constexpr,
                BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(widened_ptr + offs, triton_norm.to_float32(tl.load(narrow_ptr + offs), KIND))
        tl.store(narrowed_ptr + offs, triton_norm.from_float32(tl.load(wide_ptr + offs), KIND))

    g = torch.Generator().manual_seed(13)
    # Every 16-bit pattern to widen; float32 patterns to narrow, with subnormals and exact ties
    # (where truncation and round-half-up both differ from round-to-nearest-even).
    narrow = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    bits = torch.randint(-2**31, 2**31, (2**16,), generator=g, dtype=torch.int64).to(torch.int32)
    bits[:4096] &= 0x807FFFFF
    bits[4096:8192] = (bits[4096:8192] & ~0xFFFF) | 0x8000
    wide = bits.view(torch.float32)
    narrowed = torch.empty_like(narrow, device=triton_device)
    widened = torch.empty_like(wide, device=triton_device)
    convert[(1,)](narrow.to(triton_device), wide.to(triton_device), narrowed, widened,
                  KIND=triton_norm.DTYPE_KIND[dtype], BLOCK=2**16)
    narrowed, widened = narrowed.cpu(), widened.cpu()
    expected_wide = narrow.float()
    assert torch.equal(widened.isnan(), expected_wide.isnan())
    assert torch.equal(widened.nan_to_num(), expected_wide.nan_to_num())
    expected_narrow = wide.to(dtype)
    assert torch.equal(narrowed.isnan(), expected_narrow.isnan())
    # Bit patterns, so -0.0 and subnormals count too (NaN payloads aside).
    keep = ~expected_narrow.isnan()
    assert torch.equal(narrowed[keep].view(torch.int16), expected_narrow[keep].view(torch.int16))


def _assert_silu_close(got: torch.Tensor, x: torch.Tensor) -> None:
    """got is silu_and_mul(x) up to the last bit of an exp: float32 within a few ulps; a 16-bit
    output is torch's value, or on rare elements the product with the silu one ulp off (the one
    rounding an exp's last bit can flip, which the product with up then scales)."""
    expected = reference_silu_and_mul(x)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
        return
    gate, up = x.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate)
    neighbours = [torch.nextafter(act, torch.full_like(act, bound)) * up
                  for bound in (float("inf"), float("-inf"))]
    off = got.view(torch.int16) != expected.view(torch.int16)
    allowed = torch.zeros_like(off)
    for value in neighbours:
        allowed |= got.view(torch.int16) == value.view(torch.int16)
    assert not (off & ~allowed).any()
    assert off.float().mean().item() < 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("rows, width", [(1, 80), (7, 1000), (19, 1536), (3, 4096)])
def test_silu_and_mul_matches_the_reference(dtype, rows, width, triton_device):
    g = torch.Generator().manual_seed(rows * width)
    x = (4 * torch.randn(rows, 2 * width, generator=g)).to(dtype)
    # Saturating gates too: exp(-g) overflows (silu -> -0) or vanishes (silu -> g).
    x[0, :4] = torch.tensor([0.0, -100.0, 100.0, -30.0]).to(dtype)
    x_on = x.to(triton_device)
    x_before = x_on.clone()
    got = triton_activation.silu_and_mul(x_on)
    assert got.is_contiguous() and got.device == x_on.device
    _assert_silu_close(got.cpu(), x)
    assert torch.equal(x_on, x_before)
    if dtype != torch.float32:
        # Probe: rounding once (silu kept in float32 for the product) differs from the reference
        # far more often than the bound above allows, so the check pins where the kernel rounds.
        gate, up = x.float().chunk(2, dim=-1)
        once = (torch.nn.functional.silu(gate) * up).to(dtype)
        assert (_ulps(once, reference_silu_and_mul(x)) > 0).float().mean().item() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_reads_a_row_strided_view_without_copying(dtype, triton_device,
                                                               monkeypatch):
    g = torch.Generator().manual_seed(17)
    rows, width = 9, 96
    big = (3 * torch.randn(rows, 2 * width + 40, generator=g)).to(dtype).to(triton_device)
    x = big[:, 24:24 + 2 * width]  # the view is taken on the device, as a model would take it
    assert not x.is_contiguous() and x.stride(1) == 1
    big_before = big.clone()
    copied: list[tuple[int, ...]] = []
    real_contiguous = torch.Tensor.contiguous

    def contiguous(t: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not t.is_contiguous():
            copied.append(tuple(t.shape))
        return real_contiguous(t, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "contiguous", contiguous)
        got = triton_activation.silu_and_mul(x)
        # Probe: the spy sees a copy where one is made.
        contiguous(x)
    # The kernel read the view in place: the only copy is the probe's own.
    assert copied == [tuple(x.shape)]
    _assert_silu_close(got.cpu(), x.cpu())
    assert torch.equal(big, big_before)
    # A non-unit column stride is copied first, and gives the same values.
    cols = big[:, :2 * width].t().contiguous().t()
    assert cols.stride(1) != 1
    _assert_silu_close(triton_activation.silu_and_mul(cols).cpu(), cols.cpu())


def test_empty_inputs_give_empty_outputs(triton_device):
    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, device=triton_device)

    weight = torch.ones(64, device=triton_device)
    assert triton_norm.rms_norm(zeros(0, 64), weight, EPS).shape == (0, 64)
    out, res = triton_norm.rms_norm(zeros(0, 64), weight, EPS, zeros(0, 64))
    assert out.shape == res.shape == (0, 64)
    assert triton_rotary.apply_rotary(zeros(0, 2, 64), zeros(0, 1, 32),
                                      zeros(0, 1, 32)).shape == (0, 2, 64)
    assert triton_activation.silu_and_mul(zeros(0, 256)).shape == (0, 128)


def test_bad_inputs_raise_value_errors_naming_the_problem():
    # Every check fails before a launch, so these run wherever the tensors are.
    x = torch.zeros(4, 64)
    with pytest.raises(ValueError, match="weight has shape"):
        triton_norm.rms_norm(x, torch.ones(80), EPS)
    with pytest.raises(ValueError, match="residual has shape"):
        triton_norm.rms_norm(x, torch.ones(64), EPS, torch.zeros(3, 64))
    with pytest.raises(ValueError, match="residual dtype"):
        triton_norm.rms_norm(x, torch.ones(64), EPS, torch.zeros(4, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="x must be"):
        triton_norm.rms_norm(torch.zeros(64), torch.ones(64), EPS)
    q = torch.zeros(4, 2, 64)
    with pytest.raises(ValueError, match="cos has shape"):
        triton_rotary.apply_rotary(q, torch.zeros(4, 1, 64), torch.zeros(4, 1, 32))
    with pytest.raises(ValueError, match="sin has shape"):
        triton_rotary.apply_rotary(q, torch.zeros(4, 1, 32), torch.zeros(3, 1, 32))
    with pytest.raises(ValueError, match="sin dtype"):
        triton_rotary.apply_rotary(q, torch.zeros(4, 1, 32),
                                   torch.zeros(4, 1, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x must be"):
        triton_rotary.apply_rotary(torch.zeros(4, 64), torch.zeros(4, 1, 32),
                                   torch.zeros(4, 1, 32))
    with pytest.raises(ValueError, match="two equal halves"):
        triton_activation.silu_and_mul(torch.zeros(4, 65))
    with pytest.raises(ValueError, match="x must be"):
        triton_activation.silu_and_mul(torch.zeros(4, 2, 64))
    with pytest.raises(ValueError, match="unsupported dtype"):
        triton_activation.silu_and_mul(torch.zeros(4, 64, dtype=torch.float64))


# ---- the model's layers on the fused kernels: no per-layer casts or copies ------------------

# Ops a decoder layer may run on the fused path besides kernel launches: the four projections
# (GEMMs) and the allocation of each kernel's output. Anything else that is not a view (a cast,
# a copy, an eager add or multiply) would be an extra kernel per layer on a GPU.
_GEMMS = {"aten::linear", "aten::mm", "aten::addmm", "aten::matmul"}


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _is_view(func, args, kwargs, out) -> bool:
    """The op wrote nothing and every tensor it returned aliases one of its inputs."""
    if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        return False
    storages = {t.untyped_storage().data_ptr() for t in _tensors((args, list(kwargs.values())))}
    outs = _tensors(out)
    return bool(outs) and all(t.untyped_storage().data_ptr() in storages for t in outs)


def _layer_ops(runner, step) -> list[list[str]]:
    """Per decoder layer, the ops of one forward pass that are neither a GEMM, an allocation, a
    view nor a non-tensor query (kernel launches are stubbed out and not seen here)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    layers: list[list[str]] = []
    current: list[list[str]] = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = func._schema.name
            if current and not (name in _GEMMS or name.startswith("aten::empty")
                                or not _tensors(out) or _is_view(func, args, kwargs, out)):
                current[-1].append(name)
            return out

    def enter(_module, _args) -> None:
        current.append([])

    def leave(_module, _args, _out) -> None:
        layers.append(current.pop())

    hooks = [h for layer in runner.model.model.layers
             for h in (layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave))]
    inputs = runner.prepare_inputs(step.requests)
    try:
        with Spy():
            runner.model.forward(inputs.input_ids, inputs.positions, inputs.attn_meta,
                                 runner.kv_caches)
    finally:
        for hook in hooks:
            hook.remove()
    return layers


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_fused_layers_make_no_casts_or_copies(tiny_model, arch, triton_device, monkeypatch):
    """Between two attention ops a layer launches kernels only: no eager cast, add or copy
    (Gemma's too: its norms scale in float32 before the cast, its GeGLU, all fused)."""
    from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
    from engine.sampling_params import SamplingParams
    from kernels import variants
    from tests.utils.runner_configs import runner_config
    from workers.model_runner import ModelRunner

    # Launches are recorded but not run: what is left is the host-side work of each layer.
    monkeypatch.setattr(variants, "_run", lambda *args: None)
    # Gemma 3 in four layers: two sliding and two full, so each KV group has a second layer.
    model_dir = tiny_model(arch, num_hidden_layers=4) if arch == "gemma3" else tiny_model(arch)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    # A mixed step: a prefill chunk over a cached prefix and a decode.
    step = SchedulerOutput(step_id=1, requests=[
        ScheduledRequest(req_id="p", token_ids=[5, 6, 7], start_pos=16, block_ids=[0, 1],
                         sample=True, sampling_params=greedy),
        ScheduledRequest(req_id="d", token_ids=[9], start_pos=20, block_ids=[2, 3],
                         sample=True, sampling_params=greedy)])

    def runner(fused_ops: str) -> ModelRunner:
        # bfloat16, the GPU's dtype (float32 CPU weights would be prepacked for oneDNN).
        return ModelRunner(runner_config(model_dir, num_blocks=4, block_size=16, dtype="bfloat16",
                                         device=triton_device.type, attention_backend="triton",
                                         fused_ops=fused_ops), triton_device)

    fused = runner("auto")
    with variants.recording() as launched:
        layers = _layer_ops(fused, step)
    assert len(layers) == fused.model.num_layers
    # The first layer of each KV cache group also builds that group's attention plan, once a
    # step (AttentionMetadata.derived; Gemma 3 has a group of sliding layers and one of full).
    groups = fused.model.layer_kv_group
    firsts = {groups.index(g) for g in set(groups)}
    assert len(firsts) < len(layers)  # probe: some layer is checked
    assert [ops for i, ops in enumerate(layers) if i not in firsts] == \
        [[]] * (len(layers) - len(firsts))
    # Probe: every fused kernel was launched, so the layers really ran on them.
    assert {"_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel", "_write_kv_kernel",
            "_paged_attention_kernel"} <= {v.kernel for v in launched}
    # Probe: the spy sees the casts of the PyTorch layers (fused ops off).
    eager = _layer_ops(runner("off"), step)
    assert "aten::to" in eager[1] and "aten::mul" in eager[1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("rows, width", [(1, 80), (7, 1000), (3, 4096)])
def test_gelu_tanh_and_mul_matches_the_reference(dtype, rows, width, triton_device):
    """Gemma's GeGLU: float32 within the tanh's last bits (the interpreter's tanh is built from
    exp); 16-bit outputs torch's, or an ulp or two off on the rare element whose tanh lands on a
    rounding boundary. In the far negative tail (|GELU| under 1e-3) torch's ``1 + tanh`` itself
    cancels to a few float32 bits, and any two tanh implementations part there by many ulps of
    a value that small: those elements are held to 1e-5 absolute."""
    from workers.layers.activation import gelu_tanh_and_mul as reference

    g = torch.Generator().manual_seed(rows + width)
    x = (3 * torch.randn(rows, 2 * width, generator=g)).to(dtype)
    x[0, :4] = torch.tensor([0.0, -60.0, 60.0, -5.0]).to(dtype)  # saturating gates too
    got = triton_activation.gelu_tanh_and_mul(x.to(triton_device)).cpu()
    expected = reference(x)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        return
    tail = expected.float().abs() < 1e-3
    assert (got.float() - expected.float())[tail].abs().max().item() <= 1e-5
    ulps = _ulps(got, expected)[~tail]
    # One ulp in the rounded GELU can be two in its product with up.
    assert ulps.max().item() <= 2 and (ulps > 0).sum().item() <= max(1, ulps.numel() // 50)
    # Probe: SiLU's kernel gives another answer (the activation really is GELU's).
    assert not torch.allclose(triton_activation.silu_and_mul(x.to(triton_device)).cpu().float(),
                              expected.float(), atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_in_gemmas_order(dtype, with_residual, triton_device):
    """``scale_in_float32``: Gemma's norm (the float32 product with its float32 ``1 + w``, cast
    once), against GemmaRMSNorm's own arithmetic."""
    from workers.models.gemma import GemmaRMSNorm

    hidden = 960
    g = torch.Generator().manual_seed(5)
    norm = GemmaRMSNorm(hidden, EPS, dtype=dtype, device="cpu")
    norm.weight.data = 1 + 0.25 * torch.randn(hidden, generator=g)
    x = (3 * torch.randn(9, hidden, generator=g)).to(dtype)
    residual = torch.randn(9, hidden, generator=g).to(dtype) if with_residual else None
    expected = norm(x, residual) if with_residual else norm(x)
    on = _on(triton_device, x, norm.weight) + ([residual.to(triton_device)] if with_residual
                                                 else [])
    got = triton_norm.rms_norm(on[0], on[1], EPS, *on[2:], scale_in_float32=True)
    if with_residual:
        assert torch.equal(got[1].cpu(), expected[1])
        got, expected = got[0], expected[0]
    _assert_norm_close(got.cpu(), expected)
    if dtype != torch.float32:
        # Probe: Llama's order (rounding before the scale) gives other values.
        llama = triton_norm.rms_norm(on[0], on[1], EPS, *on[2:])
        llama = llama[0] if with_residual else llama
        assert (_ulps(llama.cpu().to(dtype), expected) > 0).float().mean().item() > 1e-2
