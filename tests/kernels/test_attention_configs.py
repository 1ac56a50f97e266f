"""The attention kernel's launch configs (kernels.triton_attention.AttentionLaunchConfig): the
default is the launch the kernel made before configs existed, a config reaches the launch, bad
ones are refused, and every candidate of the benchmark's sweep (bench/kernels/attention_sweep.py)
computes the same attention as the references: in Triton's interpreter on the CPU, compiled on
a GPU under TRITON_INTERPRET=0 (tests/utils/triton_device.py), where this also shows each candidate
compiles. The interpreter ignores warps and stages, so there the tile shapes are what is tested:
each candidate runs once, and each distinct tiling with GQA groups 1 and 4 in bf16 and fp32."""

from __future__ import annotations

# Must come before the kernels are decorated (on import): it picks interpreted or compiled.
import tests.utils.triton_device  # noqa: F401,I001

import dataclasses  # noqa: E402
from collections import defaultdict  # noqa: E402
from collections.abc import Callable, Hashable, Sequence  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import variants  # noqa: E402
from tests.utils.attention_cases import make_case  # noqa: E402
from tests.utils.triton_attention_check import _check, _triton  # noqa: E402

from bench.kernels import attention_sweep  # noqa: E402
from kernels import triton_attention  # noqa: E402

AttentionLaunchConfig = triton_attention.AttentionLaunchConfig
DecodeLaunch = triton_attention.DecodeLaunch
PrefillLaunch = triton_attention.PrefillLaunch
DEFAULT = triton_attention.DEFAULT_ATTENTION_CONFIG
KERNEL = "_paged_attention_kernel"
NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 32, 16

# (GQA group, dtype) combinations every distinct tiling runs with.
COMBOS = [(1, torch.bfloat16), (4, torch.float32), (4, torch.bfloat16), (1, torch.float32)]


def _coverage(candidates: Sequence[Any], tiling: Callable[[Any], Hashable]
              ) -> list[tuple[Any, int, torch.dtype]]:
    """(candidate, group, dtype) cases: every candidate at least once, and every tiling with
    every combination of COMBOS (candidates sharing a tiling take turns)."""
    by_tiling: dict[Hashable, list[Any]] = defaultdict(list)
    for launch in candidates:
        by_tiling[tiling(launch)].append(launch)
    cases = []
    for same in by_tiling.values():
        for i in range(max(len(same), len(COMBOS))):
            cases.append((same[i % len(same)], *COMBOS[i % len(COMBOS)]))
    return cases


def _ids(cases: list[tuple[Any, int, torch.dtype]]) -> list[str]:
    return [f"{attention_sweep.label(launch)}-g{group}-{str(dtype).removeprefix('torch.')}"
            for launch, group, dtype in cases]


DECODE_CASES = _coverage(attention_sweep.DECODE_CANDIDATES, lambda d: d.tile_n)
PREFILL_CASES = _coverage(attention_sweep.PREFILL_CANDIDATES, lambda p: (p.block_m, p.tile_n))


def _launches(seen: set[variants.Variant]) -> list[dict[str, Any]]:
    return [dict(v.constants) for v in seen if v.kernel == KERNEL]


@pytest.mark.parametrize(("launch", "group", "dtype"), DECODE_CASES, ids=_ids(DECODE_CASES))
def test_every_decode_candidate_matches_the_references(launch, group, dtype, triton_device):
    # Contexts from one key to several of the widest tile (one just past a tile edge, one
    # mid-block); split in 3, so some splits of the short ones hold no key.
    specs = [(0, 1), (128, 1), (269, 1)]
    case = make_case(specs, len(specs), NUM_KV_HEADS * group, NUM_KV_HEADS, HEAD_DIM,
                     BLOCK_SIZE, dtype, seed=launch.tile_n + group, num_blocks=48)
    config = dataclasses.replace(DEFAULT, decode=launch)
    with variants.recording() as seen:
        for splits in (1, 3):
            _check(case, _triton(case, triton_device, num_kv_splits=splits, config=config),
                   dtype)
    # Probe: both decode paths ran, with this candidate's tile and launch options.
    expected = {"BLOCK_Q": 1, "TILE_N": launch.tile_n, "num_warps": launch.num_warps,
                "num_stages": launch.num_stages}
    launches = _launches(seen)
    assert all(c.items() >= expected.items() for c in launches), launches
    assert sorted(c["SPLIT"] for c in launches) == [False, True]


@pytest.mark.parametrize(("launch", "group", "dtype"), PREFILL_CASES, ids=_ids(PREFILL_CASES))
def test_every_prefill_candidate_matches_the_references(launch, group, dtype, triton_device):
    # A chunk over a prefix ending mid-block that spans three query tiles (the last one partial),
    # and a short chunk without a prefix.
    tokens_per_tile = max(launch.block_m, group) // group
    chunk = 2 * tokens_per_tile + 5
    specs = [(37, chunk), (0, 5)]
    case = make_case(specs, 0, NUM_KV_HEADS * group, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype,
                     seed=launch.block_m + launch.tile_n + group, num_blocks=48)
    config = dataclasses.replace(DEFAULT, prefill=launch)
    with variants.recording() as seen:
        _check(case, _triton(case, triton_device, config=config), dtype)
    # Probe: one prefill launch with this candidate's tiles and launch options.
    expected = {"BLOCK_M": max(launch.block_m, group), "BLOCK_Q": tokens_per_tile,
                "TILE_N": launch.tile_n, "num_warps": launch.num_warps,
                "num_stages": launch.num_stages, "SPLIT": False}
    launches = _launches(seen)
    assert len(launches) == 1 and launches[0].items() >= expected.items(), launches


def test_the_candidates_are_distinct_and_the_smoke_ones_among_them():
    for candidates, smoke in ((attention_sweep.DECODE_CANDIDATES,
                               attention_sweep.SMOKE_DECODE_CANDIDATES),
                              (attention_sweep.PREFILL_CANDIDATES,
                               attention_sweep.SMOKE_PREFILL_CANDIDATES)):
        assert len(set(candidates)) == len(candidates)
        assert candidates[0] == smoke[0]  # the default first: the baseline of every table
        assert set(smoke) <= set(candidates) and len(set(smoke)) == 2
    assert DEFAULT == AttentionLaunchConfig(attention_sweep.DECODE_CANDIDATES[0],
                                            attention_sweep.PREFILL_CANDIDATES[0])


def test_the_default_is_the_launch_from_before_configs(triton_device):
    """Tiles 32 (decode), 64 x 64 (prefill), and Triton's own CUDA defaults for warps and stages
    (the kernel passed none), so the compiled kernels are unchanged until a sweep says so."""
    compiler = pytest.importorskip("triton.backends.nvidia.compiler")
    triton_defaults = {f.name: f.default for f in dataclasses.fields(compiler.CUDAOptions)}
    assert DEFAULT == AttentionLaunchConfig(
        decode=DecodeLaunch(tile_n=32, num_warps=triton_defaults["num_warps"],
                            num_stages=triton_defaults["num_stages"]),
        prefill=PrefillLaunch(block_m=64, tile_n=64, num_warps=triton_defaults["num_warps"],
                              num_stages=triton_defaults["num_stages"]))
    assert triton_attention.DECODE_TILE_N == 32
    # A call without a config launches the default's.
    case = make_case([(40, 1), (0, 9)], 1, 4, 2, HEAD_DIM, BLOCK_SIZE, torch.float32)
    with variants.recording() as seen:
        _triton(case, triton_device)
    decode, prefill = sorted(_launches(seen), key=lambda c: c["BLOCK_Q"])
    assert (decode["TILE_N"], decode["BLOCK_Q"], decode["num_warps"], decode["num_stages"]) \
        == (32, 1, 4, 3)
    assert (prefill["TILE_N"], prefill["BLOCK_M"], prefill["num_warps"],
            prefill["num_stages"]) == (64, 64, 4, 3)


def test_the_literal_builds_the_same_config():
    config = AttentionLaunchConfig(DecodeLaunch(tile_n=128, num_warps=8, num_stages=2),
                                   PrefillLaunch(block_m=128, tile_n=64, num_warps=8,
                                                 num_stages=4))
    namespace = {"AttentionLaunchConfig": AttentionLaunchConfig, "DecodeLaunch": DecodeLaunch,
                 "PrefillLaunch": PrefillLaunch}
    assert eval(config.literal(), namespace) == config  # noqa: S307 - our own literal
    assert eval(DEFAULT.literal(), namespace) == DEFAULT  # noqa: S307


@pytest.mark.parametrize(("build", "message"), [
    (lambda: DecodeLaunch(tile_n=48, num_warps=4, num_stages=3), "tile_n 48 is not a power"),
    (lambda: DecodeLaunch(tile_n=8, num_warps=4, num_stages=3), "tile_n 8 is not a power"),
    (lambda: DecodeLaunch(tile_n=512, num_warps=4, num_stages=3), "shortest split"),
    (lambda: DecodeLaunch(tile_n=32, num_warps=3, num_stages=3), "num_warps 3"),
    (lambda: DecodeLaunch(tile_n=32, num_warps=4, num_stages=0), "num_stages 0"),
    (lambda: PrefillLaunch(block_m=96, tile_n=64, num_warps=4, num_stages=3), "block_m 96"),
    (lambda: PrefillLaunch(block_m=64, tile_n=64, num_warps=32, num_stages=3), "num_warps 32"),
])
def test_configs_the_kernel_cannot_honour_are_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_a_prefill_launch_with_the_decode_tile_is_not_a_decode(triton_device, monkeypatch):
    """The warm-up's probe (workers.startup.kernel_warmup.missing_decode_paths) tells decode launches
    from prefill ones by more than the key tile, which a measured default may share."""
    from workers.startup.kernel_warmup import missing_decode_paths

    same_tiles = AttentionLaunchConfig(DecodeLaunch(tile_n=64, num_warps=4, num_stages=3),
                                       PrefillLaunch(block_m=64, tile_n=64, num_warps=4,
                                                     num_stages=3))
    monkeypatch.setattr(triton_attention, "DEFAULT_ATTENTION_CONFIG", same_tiles)
    prefill_only = make_case([(0, 9)], 0, 4, 2, HEAD_DIM, BLOCK_SIZE, torch.float32)
    decode_only = make_case([(40, 1)], 1, 4, 2, HEAD_DIM, BLOCK_SIZE, torch.float32)
    with variants.recording() as prefill_seen:
        _triton(prefill_only, triton_device)
    with variants.recording() as decode_seen:
        _triton(decode_only, triton_device)
    # Probe: the prefill launch really has the decode's tile and options.
    (prefill,) = _launches(prefill_seen)
    assert (prefill["TILE_N"], prefill["num_warps"], prefill["SPLIT"]) == (64, 4, False)
    assert not triton_attention.is_decode_launch(prefill)
    assert missing_decode_paths(prefill_seen, {False: (1, 40)}) == ["the unsplit decode"]
    assert missing_decode_paths(decode_seen, {False: (1, 40)}) == []


def test_the_sweep_drops_wrong_and_failing_configs(capsys):
    """A config whose output is off SDPA's, or that fails to launch, is reported as such and never
    chosen, however fast; the sweep goes on to the next."""
    fast_wrong, failing, right = (DecodeLaunch(tile_n=64, num_warps=4, num_stages=2),
                                  DecodeLaunch(tile_n=128, num_warps=8, num_stages=3),
                                  DecodeLaunch(tile_n=32, num_warps=4, num_stages=3))
    expected = torch.ones(2, 4, 8)
    calls: list[DecodeLaunch] = []

    def call(config: Any) -> torch.Tensor:
        calls.append(config.decode)
        if config.decode == failing:
            raise RuntimeError("out of resource: shared memory, Required: 262144\nmore")
        return expected + (1.0 if config.decode == fast_wrong else 0.0)

    reference = attention_sweep.Reference("2x8", call, expected, sdpa_ms=1.0, work=1e9)
    sweep = attention_sweep.KindSweep("decode", (fast_wrong, failing, right), "GB/s",
                                      lambda: [reference], [])
    timer = attention_sweep.Timer(torch.device("cpu"), 0, 1)
    results = [sweep.run(launch, timer, torch.bfloat16) for launch in sweep.candidates]
    assert results[0].status.startswith("WRONG: max|diff| 1 > 0.05 at 2x8")
    assert results[1].status == ("failed at 2x8: RuntimeError: out of resource: shared memory, "
                                 "Required: 262144")
    assert results[2].status == "ok" and set(results[2].shapes) == {"2x8"}
    # Probe: each config was called (the wrong one once, never timed), the right one timed too.
    assert calls.count(fast_wrong) == 1 and calls.count(failing) == 1
    assert calls.count(right) == 2
    assert sweep.best() is results[2]
    args = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16,
                           long_context=8)
    attention_sweep.report_kind(sweep, args, peak=100.0)
    out = capsys.readouterr().out
    assert "decode: best over all shapes t32w4s3" in out
    assert "WRONG:_max|diff|" in out and "failed_at_2x8" in out
