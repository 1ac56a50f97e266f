"""The startup warm-up launches every Triton kernel variant serving can launch, so no request
waits on a compile (workers/startup/kernel_warmup.py, kernels/variants.py).

The coverage tests stub the kernels out (the variants are recorded, nothing runs), so they sweep
many batches on a tiny model in a moment, with the split-decode choice of a GPU with 132
multiprocessors; one test runs the warm-up for real, interpreted on the CPU (or compiled on a
GPU under TRITON_INTERPRET=0)."""

from __future__ import annotations

# Must come before the kernels are decorated (on import): it picks interpreted or compiled.
import tests.utils.triton_device  # noqa: F401,I001

import itertools  # noqa: E402
import logging  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from kernels import variants  # noqa: E402
from workers.startup.kernel_warmup import (missing_decode_paths, warm_up_kernels,  # noqa: E402
                                   warmup_steps)
from workers.graphs.cuda_graphs import FAKE_GRAPHS_ENV  # noqa: E402
from workers.model_runner import ModelRunner  # noqa: E402
from workers.step_buffers import StepLimits  # noqa: E402
from tests.utils.runner_configs import runner_config  # noqa: E402

# On a GPU, bench/suite/gpu_suite.sh's tests-triton-compiled step runs the tests marked gpu.
pytestmark = pytest.mark.gpu
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels import triton_attention  # noqa: E402

H100_PROGRAMS = 2 * 132
BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024  # the tiny models' max_position_embeddings
MAX_NUM_SEQS = 40
MAX_NUM_BATCHED_TOKENS = 256
GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
ALL_KERNELS = {"_paged_attention_kernel", "_merge_splits_kernel", "_write_kv_kernel",
               "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel"}


@pytest.mark.parametrize("num_kv_heads", [1, 2, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("max_model_len", [1, 100, 511, 512, 1000, 4096])
@pytest.mark.parametrize("max_num_seqs", [1, 48])
@pytest.mark.parametrize("target", [1, H100_PROGRAMS])
def test_decode_shapes_reach_every_path_the_launch_can_take(num_kv_heads, block_size,
                                                           max_model_len, max_num_seqs, target):
    shapes = triton_attention.decode_variant_shapes(num_kv_heads, block_size, max_model_len,
                                                    max_num_seqs, target)
    # Every batch the scheduler can make: 1..max_num_seqs decodes, the longest of them with a
    # context of 1..max_model_len (its padded block table is what the launch sees).
    taken = set()
    for num_decodes in range(1, max_num_seqs + 1):
        for width in range(1, -(-max_model_len // block_size) + 1):
            splits = triton_attention.decode_splits(num_decodes, num_kv_heads,
                                                    width * block_size, target)
            taken.add(splits > 1)
    assert set(shapes) == taken
    for split, (num_decodes, context) in shapes.items():
        assert 1 <= num_decodes <= max_num_seqs and 1 <= context <= max_model_len
        width = -(-context // block_size)
        assert (triton_attention.decode_splits(num_decodes, num_kv_heads, width * block_size,
                                               target) > 1) == split


@pytest.mark.parametrize("max_model_len", [1, 2, 5, 300])
def test_warmup_steps_stay_within_max_model_len(max_model_len):
    shapes = triton_attention.decode_variant_shapes(2, BLOCK_SIZE, max_model_len, 8,
                                                    H100_PROGRAMS)
    steps = warmup_steps(shapes, max_model_len, BLOCK_SIZE)
    assert 1 <= len(steps) <= 2
    requests = [r for step in steps for r in step.requests]
    for r in requests:
        assert r.start_pos + len(r.token_ids) <= max_model_len
        assert len(r.block_ids) * BLOCK_SIZE >= r.start_pos + len(r.token_ids)
        assert set(r.block_ids) == {0}  # the warm-up writes block 0 only
    prefills = [r for r in requests if len(r.token_ids) > 1]
    assert len(prefills) == (1 if max_model_len >= 2 else 0)


def test_variants_tell_specialized_integers_apart():
    @triton.jit(do_not_specialize=["listed"])
    def kernel(ptr, listed, unlisted, BLOCK: tl.constexpr):
        pass

    x = torch.zeros(4)

    def variant(listed: int, unlisted: int, block: int = 4):
        return variants.variant_of(kernel, (x, listed, unlisted), {"BLOCK": block})

    # A listed argument compiles one variant whatever its value ...
    assert variant(1, 7) == variant(17, 7) == variant(32, 7)
    # ... an unlisted one a variant for 1, one for multiples of 16 and one for the rest.
    assert len({variant(3, 1), variant(3, 16), variant(3, 17)}) == 3
    assert variant(3, 5) != variant(3, 5, block=8)
    # A pointer's 16-byte alignment is part of it too.
    assert variants.variant_of(kernel, (x[1:], 3, 5), {"BLOCK": 4}) != variant(3, 5)


def _zero_floats(kernel, grid, args, constants) -> None:
    """The stubbed launch: zeroes the float tensors it is handed (outputs among them), so the
    forward pass goes on with zeros instead of uninitialized memory, whose NaNs and denormals
    slow the CPU's matmuls a hundredfold. Nothing else runs."""
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.is_floating_point():
            arg.zero_()


def _runner(model_dir: str, device: torch.device, num_blocks: int = 8) -> ModelRunner:
    return ModelRunner(runner_config(model_dir, num_blocks=num_blocks, block_size=BLOCK_SIZE,
                                     attention_backend="triton", fused_ops=True,
                                     limits=StepLimits(MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS,
                                                       MAX_MODEL_LEN), device=device.type),
                       device)


def _step(decode_contexts: list[int], chunks: list[tuple[int, int]]) -> SchedulerOutput:
    """Decodes at the given context lengths and prefill chunks (cached prefix, new tokens); every
    table lists block 0 only (the kernels are stubbed: nothing reads the cache)."""
    requests = [ScheduledRequest(req_id=f"d{i}", token_ids=[1], start_pos=context - 1,
                                 block_ids=[0] * -(-context // BLOCK_SIZE), sample=True,
                                 sampling_params=GREEDY)
                for i, context in enumerate(decode_contexts)]
    requests += [ScheduledRequest(req_id=f"p{i}", token_ids=[1] * new, start_pos=cached,
                                  block_ids=[0] * -(-(cached + new) // BLOCK_SIZE), sample=True,
                                  sampling_params=GREEDY)
                 for i, (cached, new) in enumerate(chunks)]
    return SchedulerOutput(step_id=1, requests=requests)


# Two heads of 8 dims: an eager pass's q/k rows are 24 elements apart (not a multiple of 16, which
# Triton specializes on), the pieces' static q buffer's 16, so with graphs on the attention op
# between pieces needs other variants than the eager warm-up launched.
NARROW_HEADS = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2,
                    num_key_value_heads=1)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "llama-narrow-heads"])
def test_the_warm_up_launches_every_variant_serving_launches(tiny_model, arch, graphs,
                                                             monkeypatch, triton_device,
                                                             request):
    """``cuda-graphs``: the startup (warm-up, capture, warm-up through the graphs) with the CPU
    stand-in for graphs, and the sweep served through decode graphs and pieces, whose attention
    ops read q/k/v from the pieces' static buffers."""
    monkeypatch.setattr(variants, "_run", _zero_floats)
    # Hundreds of tiny steps: one thread, so the CPU's matmuls never wait on idle threads.
    threads = torch.get_num_threads()
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    torch.set_num_threads(1)
    # The split choice of an H100 (132 multiprocessors), wherever this runs.
    monkeypatch.setattr(triton_attention, "target_programs", lambda device: H100_PROGRAMS)
    model = (tiny_model("llama", **NARROW_HEADS) if arch == "llama-narrow-heads"
             else tiny_model(arch))
    runner = _runner(model, triton_device)
    with variants.recording() as warm:
        if graphs:
            monkeypatch.setenv(FAKE_GRAPHS_ENV, "1")
            runner.prepare_for_serving()
            warmup = runner.kernel_warmup
        else:
            warmup = warm_up_kernels(runner, MAX_MODEL_LEN, MAX_NUM_SEQS)
    assert warmup is not None and warmup.variants == frozenset(warm)

    decode_counts = [0, 1, 2, 7, 16, 33, MAX_NUM_SEQS]
    contexts = [1, 2, 15, 16, 17, 255, 300, 512, 513, 777, MAX_MODEL_LEN]
    chunk_sets = [[], [(0, 2)], [(0, 17), (5, 64), (100, 31)], [(33, 1), (0, 128)]]
    with variants.recording() as served:
        for count, context, chunks in itertools.product(decode_counts, contexts, chunk_sets):
            if count or chunks:
                runner.execute(_step([context] * count, chunks))
        # Mixed decode contexts in one batch.
        runner.execute(_step([1, 40, MAX_MODEL_LEN, 3], [(0, 5)]))
    if graphs:
        # Probe: the sweep went through both kinds of graph.
        assert runner.graphs.replays > 0 and runner.piecewise.replays > 0

    # Probes: the sweep launched both decode paths, the merge, and every fused kernel.
    decodes = {v.constant("SPLIT") for v in served if v.kernel == "_paged_attention_kernel"
               and v.constant("TILE_N") == triton_attention.DECODE_TILE_N}
    assert decodes == {False, True}
    assert {v.kernel for v in served} == ALL_KERNELS
    # No variant is left to compile while serving, and the warm-up compiles none it does not use.
    assert served - warm == set()
    assert warm - served == set()
    shapes = triton_attention.decode_variant_shapes(
        runner.model.num_kv_heads, BLOCK_SIZE, MAX_MODEL_LEN, MAX_NUM_SEQS, H100_PROGRAMS)
    assert missing_decode_paths(warmup.variants, shapes) == []


def test_the_warm_up_runs_the_kernels_before_serving(tiny_model, triton_device, caplog):
    runner = _runner(tiny_model("llama"), triton_device, num_blocks=4)
    for key_cache, value_cache in runner.kv_caches:
        key_cache.zero_()
        value_cache.zero_()
    with caplog.at_level(logging.INFO, logger="workers.startup.kernel_warmup"):
        warmup = warm_up_kernels(runner, max_model_len=64, max_num_seqs=4)
    assert warmup is not None
    assert warmup.compiled == (triton_device.type == "cuda")
    # Interpreted on the CPU no decode splits: one step, a decode and a prefill chunk in it.
    expected_kernels = ALL_KERNELS - {"_merge_splits_kernel"}
    if triton_device.type == "cpu":
        assert warmup.steps == 1
        assert {v.kernel for v in warmup.variants} == expected_kernels
    assert {v.kernel for v in warmup.variants} >= expected_kernels
    # Probe: the kernels really ran (the steps wrote their K/V into block 0, and only there).
    key_cache, _ = runner.kv_caches[0]
    assert key_cache[0].abs().sum() > 0 and key_cache[1:].abs().sum() == 0
    (line,) = [r.getMessage() for r in caplog.records if "Triton kernels" in r.getMessage()]
    assert f"{len(warmup.variants)} variants" in line and "at startup in" in line


def test_no_warm_up_without_the_triton_kernels(tiny_model):
    model_dir = tiny_model("llama")
    runner = ModelRunner(runner_config(model_dir, num_blocks=4, block_size=BLOCK_SIZE,
                                       attention_backend="torch"), torch.device("cpu"))
    with variants.recording() as seen:
        assert warm_up_kernels(runner, 64, 4) is None
    assert seen == set()


def test_the_specialization_by_hand_agrees_with_tritons_own():
    # The fallback for a Triton without the private function the launcher uses.
    for value in (1, 0, 7, 16, 48, -1, 2**31, 3.5):
        for specialize in (True, False):
            assert variants._specialization_by_hand(value, specialize) == \
                variants._specialization(value, specialize)
    x = torch.zeros(8)
    assert variants._specialization_by_hand(x, True)[1] == variants._specialization(x, True)[1]
    assert variants._specialization_by_hand(x[1:], True)[1] == \
        variants._specialization(x[1:], True)[1]


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_the_warm_up_compiles_every_experts_variant(tiny_model, triton_device, arch):
    """A mixture of experts: the fused experts kernels in each BLOCK_M the launch can choose
    (the largest is chosen only for prefills of thousands of tokens, which no warm-up step
    makes), so a long prompt never compiles one while serving; gpt-oss's in its own variant
    (biases, the clamped SwiGLU)."""
    from kernels.triton_moe import block_m_for

    runner = _runner(tiny_model(arch), triton_device)
    warmup = warm_up_kernels(runner, MAX_MODEL_LEN, MAX_NUM_SEQS)
    assert warmup is not None
    chosen = {v.constant("BLOCK_M") for v in warmup.variants
              if v.kernel in ("_gate_up_silu_kernel", "_down_weighted_kernel")}
    experts = runner.model.model.layers[0].mlp.experts.num_experts
    assert chosen == {block_m_for(pairs, experts) for pairs in (1, 20 * experts, 100 * experts)}
    # ... at the layer's top-k, a compile-time constant of the gate/up kernel (a warm-up at
    # another would leave the served variants to compile while serving).
    block = runner.model.model.layers[0].mlp
    top_k = (block.router if arch == "gpt_oss" else block.gate).top_k
    assert {(v.constant("TOP_K"), v.constant("BLOCK_M")) for v in warmup.variants
            if v.kernel == "_gate_up_silu_kernel"} == {(top_k, m) for m in chosen}
    gpt_oss = arch == "gpt_oss"
    assert {(v.constant("HAS_BIAS"), v.constant("ACTIVATION")) for v in warmup.variants
            if v.kernel == "_gate_up_silu_kernel"} == {(gpt_oss, int(gpt_oss))}
