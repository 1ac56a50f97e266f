"""The GPU kernel benchmark's harness (bench/kernels/gpu_kernels.py and its
launch-config sweep, attention_sweep.py): the device's peak memory bandwidth, paged attention
inputs laid out as the model runner lays them out, and the printed tables. Timing (CUDA events,
L2 flushed) and the measured copy bandwidth are engine/benchmarks/measure/machine_limits.py's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# Timer and copy_gbps live with the other machine limits (Timer is re-exported for the benchmark's
# modules).
from engine.benchmarks.measure.machine_limits import Timer, copy_gbps  # noqa: F401

# Datasheet HBM/GDDR bandwidth in GB/s, by the words of torch.cuda.get_device_name (upper case,
# '-' read as a space). First match wins, so the more specific entries come first.
DATASHEET_GBPS: list[tuple[tuple[str, ...], float, str]] = [
    (("A100", "80GB", "PCIE"), 1935, "A100 80GB PCIe"),
    (("A100", "80GB"), 2039, "A100 80GB SXM"),
    (("A100",), 1555, "A100 40GB"),
    (("H100", "PCIE"), 2000, "H100 PCIe"),
    (("H100", "NVL"), 3900, "H100 NVL"),
    (("H100",), 3350, "H100 SXM"),
    (("H200",), 4800, "H200"),
    (("H800",), 3350, "H800 SXM"),
    (("B200",), 8000, "B200"),
    (("L40S",), 864, "L40S"),
    (("L40",), 864, "L40"),
    (("L4",), 300, "L4"),
    (("A10G",), 600, "A10G"),
    (("A10",), 600, "A10"),
    (("A30",), 933, "A30"),
    (("A40",), 696, "A40"),
    (("RTX", "6000", "ADA"), 960, "RTX 6000 Ada"),
    (("RTX", "A6000"), 768, "RTX A6000"),
    (("RTX", "5090"), 1792, "RTX 5090"),
    (("RTX", "4090"), 1008, "RTX 4090"),
    (("RTX", "3090", "TI"), 1008, "RTX 3090 Ti"),
    (("RTX", "3090"), 936, "RTX 3090"),
    (("V100",), 900, "V100"),
    (("T4",), 320, "T4"),
]


# Largest |triton - reference| before a row is flagged (bf16 rounds outputs of magnitude ~2-4
# to steps of 1/64, and the two sides round at different points).
TOLERANCE = {torch.bfloat16: 5e-2, torch.float16: 1e-2, torch.float32: 2e-3}

# ---------------------------------------------------------------------------------------------
# Report helpers


# Every table printed, for --output.
TABLES: list[dict[str, Any]] = []


def print_table(title: str, headers: list[str], rows: list[list[str]]) -> None:
    TABLES.append({"title": title, "headers": headers, "rows": rows})
    widths = [max([len(h)] + [len(r[i]) for r in rows if len(r) == len(headers)])
              for i, h in enumerate(headers)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for row in rows:
        if len(row) == len(headers):
            print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        else:  # a skipped shape: its leading cells, then a note
            print("  ".join(c.rjust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1])


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def fits(device: torch.device, needed: int) -> str | None:
    """None if `needed` bytes fit in 90% of the free device memory, else a skip note."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info(device)[0]
    if needed <= 0.9 * free:
        return None
    return f"skipped: needs {needed / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"


def release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Timing


# ---------------------------------------------------------------------------------------------
# Peak bandwidth


def datasheet_gbps(name: str) -> tuple[float, str] | None:
    words = set(name.upper().replace("-", " ").split())
    for needed, gbps, label in DATASHEET_GBPS:
        if all(w in words for w in needed):
            return gbps, label
    return None


def peak_bandwidth(device: torch.device, override: float | None,
                   timer: Timer) -> tuple[float, str]:
    """(GB/s, where it came from): --peak-gbps, else memory clock x bus width from the device
    properties (torch 2.13's _CudaDeviceProperties has memory_clock_rate [kHz] and
    memory_bus_width [bits]; a 0 means the driver did not say), else the datasheet table by
    device name, else a measured copy."""
    if override:
        return override, "from --peak-gbps"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        clock_khz = getattr(props, "memory_clock_rate", 0) or 0
        bus_bits = getattr(props, "memory_bus_width", 0) or 0
        table = datasheet_gbps(props.name)
        if clock_khz > 0 and bus_bits > 0:
            gbps = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9
            note = (f"from device properties: {clock_khz / 1e3:.0f} MHz memory clock x "
                    f"{bus_bits}-bit bus x 2 (double data rate)")
            if table:
                note += f"; datasheet for {table[1]}: {table[0]:.0f} GB/s"
            return gbps, note
        if table:
            return table[0], f"datasheet value for {table[1]} (matched by device name)"
    gbps = copy_gbps(device, timer)
    if device.type != "cuda":
        return gbps, "MEASURED CPU memory copy bandwidth (read + write) of this smoke run"
    return gbps, ("MEASURED device-to-device copy bandwidth (read + write), not the datasheet "
                  "peak: the device reported no memory clock/bus width and its name is not in "
                  "the table; pass --peak-gbps for the datasheet figure")


# ---------------------------------------------------------------------------------------------
# Paged inputs


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, Hq, D]
    key: torch.Tensor  # [T, Hkv, D], this step's new K/V, already in the cache
    value: torch.Tensor
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor
    meta: Any  # kernels.attention.AttentionMetadata
    tables: list[torch.Tensor]  # per sequence (decodes first): its block ids
    context_lens: list[int]


def kv_bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return num_kv_heads * head_dim * 2 * torch.empty((), dtype=dtype).element_size()


def build_batch(decode_contexts: list[int], prefills: list[tuple[int, int]], num_heads: int,
                num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                device: torch.device, seed: int) -> PagedBatch:
    """A step of decodes (context lengths including the decoded token) then prefill chunks
    ((chunk tokens, cached prefix tokens)), laid out like ModelRunner.prepare_inputs does."""
    from kernels.metadata import AttentionMetadata, padded_block_tables

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    query_lens = [1] * len(decode_contexts) + [q for q, _ in prefills]
    context_lens = list(decode_contexts) + [q + p for q, p in prefills]
    blocks = [-(-c // block_size) for c in context_lens]
    # Shuffled block ids: a sequence's blocks are scattered over the cache, as after churn.
    ids = torch.randperm(sum(blocks), generator=g)
    tables = list(ids.split(blocks))
    shape = (sum(blocks), block_size, num_kv_heads, head_dim)
    key_cache = torch.empty(shape, dtype=dtype, device=device).normal_()
    value_cache = torch.empty(shape, dtype=dtype, device=device).normal_()

    slots = []
    for q_len, ctx, table in zip(query_lens, context_lens, tables):
        pos = torch.arange(ctx - q_len, ctx)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
    slot_mapping = torch.cat(slots).to(device)
    # The new tokens' K/V are what the cache holds at their slots (the contract: already written).
    key = key_cache.view(-1, num_kv_heads, head_dim).index_select(0, slot_mapping)
    value = value_cache.view(-1, num_kv_heads, head_dim).index_select(0, slot_mapping)
    query = torch.empty((len(slot_mapping), num_heads, head_dim), dtype=dtype,
                        device=device).normal_()

    n = len(decode_contexts)
    decode_tables = padded_block_tables(tables[:n])
    meta = AttentionMetadata(
        slot_mapping=slot_mapping, num_decodes=n,
        decode_block_tables=decode_tables.to(device),
        decode_context_lens=torch.tensor(decode_contexts, dtype=torch.long, device=device),
        prefill_query_lens=[q for q, _ in prefills],
        prefill_context_lens=context_lens[n:],
        prefill_block_tables=[t.to(device) for t in tables[n:]])
    return PagedBatch(query, key, value, key_cache, value_cache, meta,
                      [t.to(device) for t in tables], context_lens)


def gather(cache: torch.Tensor, table: torch.Tensor, ctx: int, out: torch.Tensor) -> None:
    """Copy one sequence's first `ctx` cached vectors into out [Hkv, ctx, D] (head-major)."""
    _, _, num_kv_heads, head_dim = cache.shape
    out.copy_(cache.index_select(0, table).view(-1, num_kv_heads, head_dim)[:ctx].transpose(0, 1))


def gathered(batch: PagedBatch, first: int, count: int, ctx: int) -> tuple[torch.Tensor, ...]:
    """Contiguous K and V [count, Hkv, ctx, D] of sequences first..first+count-1 (all of context
    ctx), gathered row by row so the peak memory is one row above the result."""
    _, _, num_kv_heads, head_dim = batch.key_cache.shape
    result = []
    for cache in (batch.key_cache, batch.value_cache):
        out = torch.empty((count, num_kv_heads, ctx, head_dim), dtype=cache.dtype,
                          device=cache.device)
        for row in range(count):
            gather(cache, batch.tables[first + row], ctx, out[row])
        result.append(out)
    return tuple(result)


def decode_subset(batch: PagedBatch, count: int, ctx: int) -> PagedBatch:
    """The first ``count`` decodes of a decode-only batch, each cut to its first ``ctx`` tokens
    (the decoded token is then the ctx-th): views of the same paged cache, so every decode shape
    of a sweep shares one allocation, sized for the largest."""
    from kernels.metadata import AttentionMetadata

    _, block_size, num_kv_heads, head_dim = batch.key_cache.shape
    width = -(-ctx // block_size)
    tables = [t[:width] for t in batch.tables[:count]]
    last = ctx - 1
    slot_mapping = torch.stack([t[last // block_size] * block_size + last % block_size
                                for t in tables])
    key = batch.key_cache.view(-1, num_kv_heads, head_dim).index_select(0, slot_mapping)
    value = batch.value_cache.view(-1, num_kv_heads, head_dim).index_select(0, slot_mapping)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping, num_decodes=count,
        decode_block_tables=batch.meta.decode_block_tables[:count, :width].contiguous(),
        decode_context_lens=torch.full((count,), ctx, dtype=torch.long,
                                       device=batch.query.device),
        prefill_query_lens=[], prefill_context_lens=[], prefill_block_tables=[],
        decode_max_context=ctx, decode_min_context=ctx)
    return PagedBatch(batch.query[:count], key, value, batch.key_cache, batch.value_cache, meta,
                      tables, [ctx] * count)
