"""CPU paged attention against this machine's limits, every implementation side by side in one run.

Inputs are laid out as the model runner lays them out (bench/kernels/harness.py
build_batch: paged cache [num_blocks, block_size, Hkv, D], shuffled block tables,
AttentionMetadata) with the default model's attention shape (9 query heads, 3 KV heads, head_dim 64, block 16, float32). Times are
per layer, the median of repeats, interleaved across implementations so machine noise (other
processes) hits them alike.

- decode_mixed: decodes of unequal contexts (one 4000-token beside short ones), grouped by
  context (what the engine runs) against every row padded to the longest, and the ideal.
- decode: N sequences x context; achieved GB/s of the K/V the step must read, and its share of the
  memory read bandwidth measured in the same run (a sum over a large float32 tensor).
- prefill: a prompt prefilled in chunks (each chunk's queries against its cached prefix plus
  the chunk itself, causal); achieved attention GFLOP/s (4 x heads x head_dim x sum over queries
  of keys attended) and its share of fp32 matmul GFLOP/s measured in the same run (the best of a
  square 1024 GEMM and the attention's own [512, 64] x [64, 2048] per-head shape);
  x_of_roofline_time is the time over that FLOP count's time at the roofline.

Implementations: `current` is kernels.torch_attention as it is now; for decode, `baseline` is a
frozen copy of the implementation before the decode-attention rewrite (so the ratio survives
later changes; the prefill path did not change, so prefill compares against `current`); the
rest are candidates measured before choosing. Prints one JSON object.

    python -m bench.diagnostics.cpu_attention [--quick] [--candidates]
    python -m bench.diagnostics.cpu_attention --only engine  # LLM.generate, 16 x 2000-token decodes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.kernels.harness import PagedBatch, build_batch
from engine.benchmarks.measure import machine_limits
from kernels import torch_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
DTYPE = torch.float32


# ---------------------------------------------------------------------------------------------
# Baseline: the decode path as it was before the decode-attention rewrite (frozen copy;
# prefill did not change).


def baseline_decode(query, key_cache, value_cache, meta, scale):
    num_decodes, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    context_lens = meta.decode_context_lens
    n_blocks = -(-int(context_lens.max()) // block_size)
    block_ids = meta.decode_block_tables[:, :n_blocks].reshape(-1)
    slots = torch.arange(n_blocks * block_size)
    hidden = slots[None, :] >= context_lens[:, None]
    ctx = hidden.shape[-1]
    batch = num_decodes * num_kv_heads
    keys = key_cache.index_select(0, block_ids).view(num_decodes, ctx, num_kv_heads, head_dim)
    keys_f32 = torch.empty((num_decodes, num_kv_heads, ctx, head_dim), dtype=torch.float32)
    keys_f32.copy_(keys.transpose(1, 2))
    q = (query.to(torch.float32) * scale).reshape(batch, group, head_dim)
    scores = torch.bmm(q, keys_f32.view(batch, ctx, head_dim).transpose(1, 2))
    scores = scores.view(num_decodes, num_heads, ctx).masked_fill_(hidden[:, None, :],
                                                                    float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    values = value_cache.index_select(0, block_ids).view(num_decodes, ctx, num_kv_heads, head_dim)
    values.masked_fill_(hidden[:, :, None, None], 0.0)
    values = values.transpose(1, 2).contiguous().view(batch, ctx, head_dim)
    out = torch.bmm(probs.view(batch, group, ctx), values)
    return out.view(num_decodes, num_heads, head_dim)


# ---------------------------------------------------------------------------------------------
# Decode candidates (same signature as torch_attention._decode_attention).


def _head_major_gather(cache: torch.Tensor, block_ids: torch.Tensor, count: int,
                       ctx: int) -> torch.Tensor:
    """[Hkv, count, ctx, D] in one gather: index_select on the head-major view of the cache
    writes the layout bmm wants directly (no transpose copy, no dtype copy)."""
    _, _, num_kv_heads, head_dim = cache.shape
    return cache.permute(2, 0, 1, 3).index_select(1, block_ids).view(
        num_kv_heads, count, ctx, head_dim)


def decode_headmajor_gather(query, key_cache, value_cache, meta, scale):
    num_decodes, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    context_lens = meta.decode_context_lens
    n_blocks = -(-int(context_lens.max()) // block_size)
    block_ids = meta.decode_block_tables[:, :n_blocks].reshape(-1)
    ctx = n_blocks * block_size
    hidden = torch.arange(ctx)[None, :] >= context_lens[:, None]
    batch = num_kv_heads * num_decodes
    keys = _head_major_gather(key_cache, block_ids, num_decodes, ctx).view(batch, ctx, head_dim)
    # [B, Hq, D] -> [Hkv, B, group, D]: query head h reads KV head h // group.
    q = (query * scale).view(num_decodes, num_kv_heads, group, head_dim).transpose(0, 1)
    scores = torch.bmm(q.reshape(batch, group, head_dim), keys.transpose(1, 2))
    scores = scores.view(num_kv_heads, num_decodes, group, ctx)
    scores.masked_fill_(hidden[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    values = _head_major_gather(value_cache, block_ids, num_decodes, ctx)
    values.masked_fill_(hidden[None, :, :, None], 0.0)
    out = torch.bmm(probs.view(batch, group, ctx), values.view(batch, ctx, head_dim))
    return out.view(num_kv_heads, num_decodes, group, head_dim).transpose(0, 1).reshape(
        num_decodes, num_heads, head_dim)


def decode_headmajor_tailmask(query, key_cache, value_cache, meta, scale):
    """As decode_headmajor_gather, but masking touches only slots at or past the shortest
    context (every slot below it is visible to every sequence); none when all are full blocks."""
    num_decodes, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    context_lens = meta.decode_context_lens
    longest, shortest = int(context_lens.max()), int(context_lens.min())
    n_blocks = -(-longest // block_size)
    block_ids = meta.decode_block_tables[:, :n_blocks].reshape(-1)
    ctx = n_blocks * block_size
    tail = torch.arange(shortest, ctx)
    hidden = tail[None, :] >= context_lens[:, None]  # [B, ctx - shortest]
    batch = num_kv_heads * num_decodes
    keys = _head_major_gather(key_cache, block_ids, num_decodes, ctx).view(batch, ctx, head_dim)
    q = (query * scale).view(num_decodes, num_kv_heads, group, head_dim).transpose(0, 1)
    scores = torch.bmm(q.reshape(batch, group, head_dim), keys.transpose(1, 2))
    scores = scores.view(num_kv_heads, num_decodes, group, ctx)
    if shortest < ctx:
        scores[..., shortest:].masked_fill_(hidden[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    values = _head_major_gather(value_cache, block_ids, num_decodes, ctx)
    if shortest < ctx:
        values[:, :, shortest:].masked_fill_(hidden[None, :, :, None], 0.0)
    out = torch.bmm(probs.view(batch, group, ctx), values.view(batch, ctx, head_dim))
    return out.view(num_kv_heads, num_decodes, group, head_dim).transpose(0, 1).reshape(
        num_decodes, num_heads, head_dim)


def decode_sdpa(query, key_cache, value_cache, meta, scale):
    """SDPA (flash CPU kernel) on the head-major gathered K/V, GQA by grouping the queries as
    rows of their KV head; V masked only past the shortest context."""
    num_decodes, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    context_lens = meta.decode_context_lens
    shortest = int(context_lens.min())
    n_blocks = -(-int(context_lens.max()) // block_size)
    block_ids = meta.decode_block_tables[:, :n_blocks].reshape(-1)
    ctx = n_blocks * block_size
    visible = torch.arange(ctx)[None, :] < context_lens[:, None]
    keys = _head_major_gather(key_cache, block_ids, num_decodes, ctx)
    values = _head_major_gather(value_cache, block_ids, num_decodes, ctx)
    if shortest < ctx:
        values[:, :, shortest:].masked_fill_(~visible[None, :, shortest:, None], 0.0)
    q = query.view(num_decodes, num_kv_heads, group, head_dim).transpose(0, 1)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[None, :, None, :],
                                         scale=scale)
    return out.transpose(0, 1).reshape(num_decodes, num_heads, head_dim)


# ---------------------------------------------------------------------------------------------
# Prefill candidates (same signature as torch_attention._prefill_attention).


def _gather_prefix(cache, meta, index, count):
    """[Hkv, count, D]: the first `count` cached vectors of chunk `index`, head-major."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    block_ids = meta.prefill_block_tables[index][:-(-count // block_size)]
    return cache.permute(2, 0, 1, 3).index_select(1, block_ids).view(
        num_kv_heads, -1, head_dim)[:, :count]


def prefill_lower_right(query, key, value, key_cache, value_cache, meta, index, scale):
    """SDPA with torch's lower-right causal bias over the head-major gathered context."""
    from torch.nn.attention.bias import causal_lower_right

    q_len, ctx_len = meta.prefill_query_lens[index], meta.prefill_context_lens[index]
    keys = _gather_prefix(key_cache, meta, index, ctx_len)
    values = _gather_prefix(value_cache, meta, index, ctx_len)
    q = query.transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(q, keys.unsqueeze(0), values.unsqueeze(0),
                                         attn_mask=causal_lower_right(q_len, ctx_len),
                                         scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def prefill_split_lse(query, key, value, key_cache, value_cache, meta, index, scale):
    """Two flash-kernel calls merged by their log-sum-exp: the chunk against its cached prefix
    (no mask at all) and the chunk against itself (is_causal, where the flash kernel skips the
    masked tiles); no [q, ctx] mask is ever built."""
    q_len, ctx_len = meta.prefill_query_lens[index], meta.prefill_context_lens[index]
    num_heads = query.shape[1]
    group = num_heads // key.shape[1]
    q = query.transpose(0, 1).unsqueeze(0)
    own_k = key.transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0)
    own_v = value.transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(q, own_k, own_v, is_causal=True, scale=scale)[:2]
    prefix = ctx_len - q_len
    if prefix == 0:
        return out.squeeze(0).transpose(0, 1)
    pk = _gather_prefix(key_cache, meta, index, prefix).repeat_interleave(group, 0).unsqueeze(0)
    pv = _gather_prefix(value_cache, meta, index, prefix).repeat_interleave(group, 0).unsqueeze(0)
    out_p, lse_p = flash(q, pk, pv, scale=scale)[:2]
    # Merge: weights exp(lse_i - lse) with lse = logaddexp(lse_1, lse_2).
    total = torch.logaddexp(lse, lse_p)
    merged = out * torch.exp(lse - total).unsqueeze(-1) + out_p * torch.exp(
        lse_p - total).unsqueeze(-1)
    return merged.squeeze(0).transpose(0, 1)


def prefill_matmul(query, key, value, key_cache, value_cache, meta, index, scale):
    """Hand-written: scores = Q K^T per KV-head group (queries of a group stacked as rows), an
    offset-causal mask, softmax, probs V."""
    q_len, ctx_len = meta.prefill_query_lens[index], meta.prefill_context_lens[index]
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    keys = _gather_prefix(key_cache, meta, index, ctx_len)  # [Hkv, ctx, D]
    values = _gather_prefix(value_cache, meta, index, ctx_len)
    q = (query * scale).view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    q = q.reshape(num_kv_heads, group * q_len, head_dim)
    scores = torch.bmm(q, keys.transpose(1, 2)).view(num_kv_heads, group, q_len, ctx_len)
    rows = torch.arange(ctx_len - q_len, ctx_len)
    scores.masked_fill_(torch.arange(ctx_len)[None, :] > rows[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(num_kv_heads, group * q_len, ctx_len)
    out = torch.bmm(probs, values).view(num_kv_heads, group, q_len, head_dim)
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)


# ---------------------------------------------------------------------------------------------
# Limits measured in this run


def _median_ms(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def read_gbps(repeats: int) -> float:
    """Memory read bandwidth: a sum over 512 MiB of float32 (far past the L3), measured by
    engine/benchmarks/measure/machine_limits.py."""
    cpu = torch.device("cpu")
    return machine_limits.read_gbps(cpu, machine_limits.Timer(cpu, warmup=1, repeats=repeats),
                                    512 << 20)


def matmul_gflops(repeats: int) -> float:
    """fp32 matmul roofline: the best of a square 1024 GEMM (engine/benchmarks/measure/machine_limits.py)
    and the attention's own score shape (per head [512, 64] x [64, 2048], batched); the square
    one is normally the faster."""
    cpu = torch.device("cpu")
    square = 1000 * machine_limits.matmul_tflops(
        cpu, torch.float32, 1024, machine_limits.Timer(cpu, warmup=1, repeats=repeats))
    qa, kb = torch.randn(HEADS, 512, HEAD_DIM), torch.randn(HEADS, HEAD_DIM, 2048)
    ms = _median_ms(lambda: torch.bmm(qa, kb), repeats)
    return max(square, 2 * HEADS * 512 * HEAD_DIM * 2048 / (ms / 1000) / 1e9)


# ---------------------------------------------------------------------------------------------
# Cases


def _interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms per implementation, calls interleaved round-robin (noise hits all alike)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            started = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - started) * 1000)
    return {name: statistics.median(t) for name, t in times.items()}


def _check(outs: dict[str, torch.Tensor], ref: torch.Tensor) -> dict[str, float]:
    return {name: float((o.double() - ref.double()).abs().max()) for name, o in outs.items()}


def decode_case(count: int, ctx: int, impls: dict[str, Callable], repeats: int,
                gbps: float) -> dict:
    batch = build_batch([ctx] * count, [], HEADS, KV_HEADS, HEAD_DIM, BLOCK, DTYPE,
                        torch.device("cpu"), seed=count * 7919 + ctx)
    scale = HEAD_DIM ** -0.5

    def runner(fn: Callable) -> Callable[[], torch.Tensor]:
        # The per-step plan is built on the first layer and reused: time a later layer's call.
        def call() -> torch.Tensor:
            return fn(batch.query, batch.key_cache, batch.value_cache, batch.meta, scale)
        return call

    fns = {name: runner(fn) for name, fn in impls.items()}
    outs = {name: fn() for name, fn in fns.items()}
    ms = _interleaved(fns, repeats)
    kv_bytes = count * ctx * KV_HEADS * HEAD_DIM * 2 * 4
    return {
        "sequences": count, "context": ctx, "kv_mib": round(kv_bytes / 2**20, 2),
        "ms": {n: round(v, 3) for n, v in ms.items()},
        "gbps": {n: round(kv_bytes / (v / 1000) / 1e9, 2) for n, v in ms.items()},
        "share_of_read_bw": {n: round(kv_bytes / (v / 1000) / 1e9 / gbps, 3)
                             for n, v in ms.items()},
        "speedup_vs_baseline": {n: round(ms["baseline"] / v, 2) for n, v in ms.items()},
        "max_abs_diff_vs_baseline": _check(outs, outs["baseline"]),
    }


def mixed_decode_case(contexts: list[int], repeats: int) -> dict:
    """Decodes of unequal contexts (one long beside short ones, as when a document finishes
    its prefill beside chat turns): the current kernel with the host context lengths the
    model runner passes (grouped by context) against the same kernel without them (every row
    padded to the longest context, as before grouping), and the rows' ideal cost, each
    context's decodes timed alone."""
    scale = HEAD_DIM ** -0.5
    batch = build_batch(contexts, [], HEADS, KV_HEADS, HEAD_DIM, BLOCK, DTYPE,
                        torch.device("cpu"), seed=len(contexts) * 31 + max(contexts))
    grouped_meta = dataclasses.replace(batch.meta, decode_context_list=list(contexts))
    padded_meta = dataclasses.replace(batch.meta, decode_context_list=None)
    decode = torch_attention._decode_attention

    def call(meta) -> Callable[[], torch.Tensor]:
        return lambda: decode(batch.query, batch.key_cache, batch.value_cache, meta, scale)

    alone = {}
    for ctx in sorted(set(contexts)):
        rows = [c for c in contexts if c == ctx]
        part = build_batch(rows, [], HEADS, KV_HEADS, HEAD_DIM, BLOCK, DTYPE,
                           torch.device("cpu"), seed=ctx)
        alone[f"alone_{ctx}"] = (lambda b=part: decode(b.query, b.key_cache, b.value_cache,
                                                       b.meta, scale))
    fns = {"grouped": call(grouped_meta), "padded": call(padded_meta), **alone}
    outs = {name: fns[name]() for name in ("grouped", "padded")}
    ms = _interleaved(fns, repeats)
    ideal = sum(v for name, v in ms.items() if name.startswith("alone_"))
    return {"contexts": contexts, "ms": {n: round(v, 3) for n, v in ms.items()},
            "ideal_ms": round(ideal, 3),
            "padded_over_grouped": round(ms["padded"] / ms["grouped"], 2),
            "grouped_over_ideal": round(ms["grouped"] / ideal, 2),
            "max_abs_diff": _check({"grouped": outs["grouped"]}, outs["padded"])["grouped"]}


def _chunk_batches(prompt: int, chunk: int, seed: int) -> list[PagedBatch]:
    return [build_batch([], [(min(chunk, prompt - start), start)], HEADS, KV_HEADS, HEAD_DIM,
                        BLOCK, DTYPE, torch.device("cpu"), seed=seed + start)
            for start in range(0, prompt, chunk)]


def prefill_case(prompt: int, chunk: int, impls: dict[str, Callable], repeats: int,
                 gflops: float) -> dict:
    batches = _chunk_batches(prompt, chunk, seed=prompt + chunk)
    scale = HEAD_DIM ** -0.5

    def runner(fn: Callable) -> Callable[[], list[torch.Tensor]]:
        def call() -> list[torch.Tensor]:
            return [fn(b.query, b.key, b.value, b.key_cache, b.value_cache, b.meta, 0, scale)
                    for b in batches]
        return call

    fns = {name: runner(fn) for name, fn in impls.items()}
    outs = {name: torch.cat(fn()) for name, fn in fns.items()}
    ms = _interleaved(fns, repeats)
    # Query i of the prompt attends to i + 1 keys.
    flops = 4 * HEADS * HEAD_DIM * prompt * (prompt + 1) / 2
    return {
        "prompt": prompt, "chunk": chunk, "attention_gflop": round(flops / 1e9, 2),
        "ms": {n: round(v, 2) for n, v in ms.items()},
        "gflops": {n: round(flops / (v / 1000) / 1e9, 1) for n, v in ms.items()},
        "share_of_matmul": {n: round(flops / (v / 1000) / 1e9 / gflops, 3)
                            for n, v in ms.items()},
        "x_of_roofline_time": {n: round(v / 1000 / (flops / (gflops * 1e9)), 2)
                               for n, v in ms.items()},
        # The rewrite left the prefill path as it was: the engine's own function is the reference.
        "speedup_vs_current": {n: round(ms["current"] / v, 2) for n, v in ms.items()},
        "max_abs_diff_vs_current": _check(outs, outs["current"]),
    }


# ---------------------------------------------------------------------------------------------
# End to end: LLM.generate with the baseline decode path patched back in vs the current one


def engine_decode(requests: int, context: int, max_tokens: int, repeats: int) -> dict:
    """Decode tokens/s of `requests` concurrent requests over `context`-token prompts, baseline
    vs current decode attention in the same engine (TP=1 runs the model in this process, so the
    module function is swapped between runs). The prompts share all but their last block, so
    one prefill up front fills the prefix cache and the timed runs are decode steps (each request
    still reads its whole context through its own block table)."""
    from engine import LLM, SamplingParams

    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, 40000, (context - BLOCK,), generator=g).tolist()
    prompts = [{"prompt_token_ids": prefix + torch.randint(100, 40000, (BLOCK,),
                                                             generator=g).tolist()}
               for _ in range(requests)]
    llm = LLM(dtype="float32", device="cpu", enable_prefix_caching=True, max_num_seqs=requests)
    current = torch_attention._decode_attention
    impls = {"baseline": baseline_decode, "current": current}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in impls}
    tokens: dict[str, list] = {}
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        for _ in range(repeats):
            for name, fn in impls.items():
                torch_attention._decode_attention = fn
                started = time.perf_counter()
                outs = llm.generate(prompts, params)
                times[name].append(time.perf_counter() - started)
                tokens[name] = [list(o.token_ids) for o in outs]
    finally:
        torch_attention._decode_attention = current
        llm.shutdown()
    s = {name: statistics.median(t) for name, t in times.items()}
    return {"requests": requests, "context": context, "shared_prefix": context - BLOCK,
            "max_tokens": max_tokens,
            "seconds": {n: [round(x, 2) for x in t] for n, t in times.items()},
            "decode_tokens_per_s": {n: round(requests * max_tokens / v, 2) for n, v in s.items()},
            "speedup_vs_baseline": round(s["baseline"] / s["current"], 2),
            "same_tokens": tokens["baseline"] == tokens["current"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="fewer cases and repeats")
    parser.add_argument("--only", choices=["decode", "prefill", "engine"], default=None)
    parser.add_argument("--candidates", action="store_true",
                        help="also time the rejected candidates (not only baseline vs current)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's, as the engine's worker sets; 1 "
                        "gives steadier ratios when other processes share the cores)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    repeats = 3 if args.quick else args.repeats

    decode_impls: dict[str, Callable] = {"baseline": baseline_decode,
                                         "current": torch_attention._decode_attention}
    prefill_impls: dict[str, Callable] = {"current": torch_attention._prefill_attention}
    if args.candidates:
        decode_impls |= {"headmajor_gather": decode_headmajor_gather,
                         "headmajor_tailmask": decode_headmajor_tailmask, "sdpa": decode_sdpa}
        prefill_impls |= {"lower_right_bias": prefill_lower_right,
                          "split_lse": prefill_split_lse, "matmul_softmax": prefill_matmul}

    result: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                    "dtype": "float32",
                    "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                              "block_size": BLOCK}}
    gbps = read_gbps(repeats)
    gflops = matmul_gflops(repeats)
    result["limits"] = {"read_gbps": round(gbps, 2), "fp32_matmul_gflops": round(gflops, 1)}
    if args.only == "engine":
        # End to end only (slow: the prompts' prefill comes first).
        result["engine"] = engine_decode(16, 2000, 8 if args.quick else 32,
                                         repeats=2 if args.quick else 3)
        print(json.dumps(result, indent=1))
        return
    if args.only in (None, "decode"):
        counts = [1, 16] if args.quick else [1, 16, 64]
        result["decode"] = [decode_case(n, ctx, decode_impls, repeats, gbps)
                            for n in counts for ctx in (64, 2000)]
        result["decode_mixed"] = [mixed_decode_case(c, repeats) for c in (
            [4000] + [100] * 5, [4000, 2000] + [100] * 14)]
    if args.only in (None, "prefill"):
        chunks = [(3072, 512), (3072, 3072)] if args.quick else [
            (3072, 512), (3072, 2048), (3072, 3072)]
        result["prefill"] = [prefill_case(p, c, prefill_impls, repeats, gflops)
                             for p, c in chunks]
    # Limits again at the end: the machine is shared, so a drift shows here.
    result["limits_at_end"] = {"read_gbps": round(read_gbps(repeats), 2),
                               "fp32_matmul_gflops": round(matmul_gflops(repeats), 1)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
