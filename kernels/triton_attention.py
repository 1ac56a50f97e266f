"""Triton paged attention for a flattened mixed batch (the CUDA implementation).

Same contract as `kernels.torch_attention.paged_attention`: decodes first, then prefill chunks,
K/V read from the paged cache through block tables (this step's new K/V are already written
there, so the kernel never looks at ``key``/``value``).

One kernel serves both kinds of query. A program owns one KV head and a tile of query rows; a row
is a (query token, query head of that KV head's group) pair, so GQA packs the group's heads into
the tile's rows and each K/V tile loaded feeds all of them. The program walks its sequence's
context in tiles of keys, looking each key's block up in the block table, and keeps an online
softmax in float32 (base 2). A query token at position p sees keys 0..p: within a prefill chunk
that is causal, over the cached prefix it is full, and a decode sees its whole context. A layer
with a sliding window W (a runtime argument, 0 for none: no variant of its own) sees only the
keys after p - W, and a tile starts at its first row's window. Gemma 2's soft-capped scores
(``softcap * tanh(s / softcap)``) are a constexpr of their own, and so are gpt-oss's attention
sinks (a logit per head that counts in the softmax denominator and holds no value): the online
softmax starts from the sink (its running max the sink, its sum 1), or, where a decode's context
is split, the merge weighs the sink beside the splits' log-sum-exps.

The batch is launched twice with different tile shapes: decodes with one query token per tile
(the rows are just the group's heads), prefill chunks with many tokens per tile so that each K/V
tile read is reused by many rows. Decodes over long contexts with few (sequence, KV head) pairs
cannot fill a GPU, so their context is split across programs (flash-decoding): each split writes
a normalized partial output and its log-sum-exp, and a second kernel merges them. The launch fixes
only the split count; each row divides its own context among the splits inside the kernel, so a
plan made for a longer context (a CUDA graph captured for max_model_len) still spreads a short
row's keys over every split.

A captured step (a CUDA graph replayed for any mix of decodes and chunks of one padded token
count) is launched once, from a ``DeviceLayout``: every sequence, decodes included, is a chunk in
the prefill launch, over a grid fixed for the token count (``ceil(tokens / BLOCK_Q)`` tiles plus
one per sequence, the spare ones pointing at a sequence of no tokens).

No compile-time constant depends on the batch: the split count is a runtime argument (only
whether a decode launch splits at all is a constexpr), and every integer argument that changes
with the batch is listed in ``do_not_specialize``. So a model compiles at most four variants:
decode, split decode, merge and prefill; ``decode_variant_shapes`` names a batch that takes each
decode path, and the engine launches them all at startup (``workers.startup.kernel_warmup``).

The tile sizes and Triton's launch options (warps, pipelining stages) are data, an
``AttentionLaunchConfig`` per kind of launch. The engine runs ``DEFAULT_ATTENTION_CONFIG``;
``python -m bench.kernels.gpu_kernels --sweep-configs`` times candidates against SDPA on a GPU and prints
the one a default should be, and the default changes only from such measured figures.

Runs compiled on CUDA, and on CPU under Triton's interpreter (TRITON_INTERPRET=1) for tests.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import triton
import triton.language as tl

from kernels.metadata import padded_block_tables
from kernels.variants import launch

if TYPE_CHECKING:
    from kernels.metadata import AttentionMetadata, DeviceLayout

_LOG2E = 1.4426950408889634
# A decode split covers at least this many keys: shorter ones cost more to merge than they save.
_MIN_SPLIT_KEYS = 256
# At most this many splits per decode: the merge kernel's (compile-time) width.
MAX_SPLITS = 32


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _check_launch_options(kind: str, num_warps: int, num_stages: int) -> None:
    if not _is_power_of_two(num_warps) or num_warps > 16:
        raise ValueError(f"{kind} num_warps {num_warps} is not a power of two in 1..16")
    if num_stages < 1:
        raise ValueError(f"{kind} num_stages {num_stages} is below 1")


def _check_tile(kind: str, name: str, value: int) -> None:
    # tl.dot needs every dimension of its operands to be a power of two of at least 16.
    if not _is_power_of_two(value) or value < 16:
        raise ValueError(f"{kind} {name} {value} is not a power of two >= 16")


@dataclass(frozen=True)
class DecodeLaunch:
    """How decodes are launched. A decode program's rows are its KV head's group of query heads
    (one token), padded to a power of two of at least 16, so only the key tile is free."""

    # Keys per inner-loop tile. Independent of the KV block size: every key looks its block up.
    tile_n: int
    # Triton launch options: warps per program, software-pipelining depth of the K/V loads.
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        _check_tile("decode", "tile_n", self.tile_n)
        # Splits are whole tiles: a tile longer than the shortest split decode_splits plans would
        # leave planned splits empty (correct, but a launch of programs that do nothing).
        if self.tile_n > _MIN_SPLIT_KEYS:
            raise ValueError(f"decode tile_n {self.tile_n} is longer than the shortest split "
                             f"({_MIN_SPLIT_KEYS} keys)")
        _check_launch_options("decode", self.num_warps, self.num_stages)


@dataclass(frozen=True)
class PrefillLaunch:
    """How prefill chunks are launched."""

    # Query rows per program (tokens x group heads); a group wider than this gets a tile of one
    # token with the group's heads (padded to a power of two).
    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        _check_tile("prefill", "block_m", self.block_m)
        _check_tile("prefill", "tile_n", self.tile_n)
        _check_launch_options("prefill", self.num_warps, self.num_stages)


@dataclass(frozen=True)
class AttentionLaunchConfig:
    """Tile sizes and launch options of the attention kernel, per kind of launch (the two are
    independent: a decode launch never runs the prefill tiling and the other way round).
    ``python -m bench.kernels.gpu_kernels --sweep-configs`` times candidates on a GPU and prints the best
    as a literal of this class; the default changes only from such measured figures."""

    decode: DecodeLaunch
    prefill: PrefillLaunch

    def literal(self) -> str:
        """Python source that builds this config (the sweep prints it, ready to paste)."""
        return (f"AttentionLaunchConfig(\n"
                f"    decode=DecodeLaunch(tile_n={self.decode.tile_n}, "
                f"num_warps={self.decode.num_warps}, num_stages={self.decode.num_stages}),\n"
                f"    prefill=PrefillLaunch(block_m={self.prefill.block_m}, "
                f"tile_n={self.prefill.tile_n}, num_warps={self.prefill.num_warps}, "
                f"num_stages={self.prefill.num_stages}))")


# What the kernel ran before launch configs existed: its tiles then, and Triton's CUDA defaults
# for the launch options (4 warps, 3 stages; tests/kernels/test_attention_configs.py checks them
# against
# the installed Triton), so the compiled kernels are the same until a sweep measures better.
DEFAULT_ATTENTION_CONFIG = AttentionLaunchConfig(
    decode=DecodeLaunch(tile_n=32, num_warps=4, num_stages=3),
    prefill=PrefillLaunch(block_m=64, tile_n=64, num_warps=4, num_stages=3))
# The default decode tile, by its old name (tests tell decode launches apart by it).
DECODE_TILE_N = DEFAULT_ATTENTION_CONFIG.decode.tile_n


# Arguments that change with the batch would otherwise be specialized (to a constant when 1, as
# a multiple of 16 when one) and compile a new variant mid-serving.
@triton.jit(do_not_specialize=["stride_bt", "num_splits", "window", "softcap"])
def _paged_attention_kernel(
        out_ptr, query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr,
        tile_seq_ptr, tile_query_offset_ptr, query_start_ptr, query_len_ptr, context_len_ptr,
        partial_out_ptr, partial_lse_ptr, sinks_ptr,
        qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
        cache_stride_block, cache_stride_slot, cache_stride_head, head_dim, num_splits, window,
        softcap, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        TILE_N: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
        SOFTCAP: tl.constexpr, SINKS: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    query_offset = tl.load(tile_query_offset_ptr + tile)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_len_ptr + seq)
    context_len = tl.load(context_len_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    token = query_offset + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (token < query_len)
    # Absolute position of each row's token: the chunk is the last query_len of the context.
    position = context_len - query_len + token
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < head_dim

    q_offsets = (query_start + token)[:, None] * stride_qt + head[:, None] * stride_qh \
        + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if DOT_UPCAST:
        q = q.to(tl.float32)

    # Keys past the tile's last token are invisible to every row of it.
    last_token = tl.minimum(query_offset + BLOCK_Q, query_len)
    kv_end = context_len - query_len + last_token
    # A sliding window (window > 0): keys before the tile's first row's window are invisible to
    # every row of it (a row at position p sees the keys after p - window, HF's mask).
    # No branch on it: a runtime if would have to agree on kv_lo's type in both arms.
    kv_lo = tl.where(window > 0,
                     tl.maximum(context_len - query_len + query_offset - window + 1, 0), 0)
    # Each row's last invisible key: -1 (none) without a window.
    window_edge = tl.where(window > 0, position - window, -1)
    kv_hi = kv_end
    if SPLIT:
        # Each row shares its own keys evenly among the splits, in whole tiles. The split count
        # may be planned for a far longer context than this row's (a CUDA graph captured for
        # max_model_len freezes it), so a length derived from the launch's longest context would
        # leave a short row's keys all in its first split. A split past the row's keys runs no
        # iteration and writes lse -inf, which the merge weighs at zero.
        split_len = (kv_end - kv_lo + num_splits - 1) // num_splits
        split_len = (split_len + TILE_N - 1) // TILE_N * TILE_N
        kv_lo = kv_lo + split * split_len
        kv_hi = tl.minimum(kv_end, kv_lo + split_len)

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    if SINKS and not SPLIT:
        # The head's sink, in base 2 as the scores: a key of weight exp(sink) and no value (a
        # split decode's merge adds it instead, once).
        row_max = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) \
            * 1.4426950408889634
        row_sum = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for start in range(kv_lo, kv_hi, TILE_N):
        keys = start + tl.arange(0, TILE_N)
        key_valid = keys < kv_hi
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_valid, other=0)
        kv_offsets = (block * cache_stride_block + (keys % BLOCK_SIZE) * cache_stride_slot
                      + kv_head * cache_stride_head)[:, None] + dims[None, :]
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(key_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if DOT_UPCAST:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            # Gemma 2: softcap * tanh(s / softcap) on the natural-log scores s (qk_scale holds
            # log2(e)), tanh as 1 - 2 / (exp(2x) + 1) (saturating, never NaN).
            x = scores / (softcap * 1.4426950408889634)
            scores = (1.0 - 2.0 / (tl.exp2(2.0 * 1.4426950408889634 * x) + 1.0)) \
                * (softcap * 1.4426950408889634)
        visible = (keys[None, :] <= position[:, None]) & (keys[None, :] > window_edge[:, None]) \
            & key_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        # A row that has seen no visible key yet keeps -inf; shift it by 0 instead (no NaN).
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        v = tl.load(value_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        # The probabilities are rounded to the cache dtype for the tensor cores either way.
        probs = probs.to(v.dtype)
        if DOT_UPCAST:
            probs, v = probs.to(tl.float32), v.to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(probs, v, input_precision=DOT_PRECISION)
        row_max = new_max

    safe_sum = tl.where(row_sum == 0.0, 1.0, row_sum)
    result = acc / safe_sum[:, None]
    if not SPLIT:
        o_offsets = (query_start + token)[:, None] * stride_ot + head[:, None] * stride_oh \
            + dims[None, :]
        tl.store(out_ptr + o_offsets, result.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None] & dim_valid[None, :])
    else:
        # Partials are [token, head, split, HEAD_PAD] float32 and lse [token, head, split], in
        # base 2; a split that saw no key has lse -inf and weighs nothing in the merge.
        lse = tl.where(row_sum == 0.0, float("-inf"), row_max + tl.log2(safe_sum))
        entry = ((query_start + token) * (tl.num_programs(1) * GROUP) + head) * num_splits + split
        tl.store(partial_lse_ptr + entry, lse, mask=row_valid)
        tl.store(partial_out_ptr + entry[:, None] * HEAD_PAD + dims[None, :], result,
                 mask=row_valid[:, None])


# The split count is a runtime argument under a fixed width (masked lanes cost no memory traffic),
# so one variant merges any count.
@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(out_ptr, partial_out_ptr, partial_lse_ptr, sinks_ptr, stride_ot,
                         stride_oh, num_heads, head_dim, num_splits, SPLITS_PAD: tl.constexpr,
                         HEAD_PAD: tl.constexpr, SINKS: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    entry = (token * num_heads + head) * num_splits + splits
    lse = tl.load(partial_lse_ptr + entry, mask=splits < num_splits, other=float("-inf"))
    if SINKS:
        # The sink weighs beside the splits (base 2), holding no value.
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(tl.max(lse, 0), sink)
        weights = tl.exp2(lse - top)
        weights = weights / (tl.sum(weights, 0) + tl.exp2(sink - top))
    else:
        weights = tl.exp2(lse - tl.max(lse, 0))
        weights = weights / tl.sum(weights, 0)
    partial = tl.load(partial_out_ptr + entry[:, None] * HEAD_PAD + dims[None, :],
                      mask=(splits < num_splits)[:, None], other=0.0)
    result = tl.sum(partial * weights[:, None], 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             result.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, *,
                    num_kv_splits: int | None = None,
                    out: torch.Tensor | None = None,
                    config: AttentionLaunchConfig | None = None,
                    sliding_window: int | None = None,
                    softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """See `kernels.attention.paged_attention`. ``num_kv_splits`` fixes how many programs share
    each decode's context (default: chosen from the device's size and the batch; at most
    MAX_SPLITS). ``config``: the tiles and launch options (default: DEFAULT_ATTENTION_CONFIG,
    looked up at each call; the benchmark's sweep and the tests pass others)."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    layout = meta.device_layout
    _check_inputs(query, key_cache, value_cache, meta, num_tokens, num_heads, num_kv_heads,
                  head_dim, cache_head_dim, padded=layout is not None)
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = _output(query, out)
    if num_kv_splits is not None and not 1 <= num_kv_splits <= MAX_SPLITS:
        raise ValueError(f"num_kv_splits {num_kv_splits} is outside 1..{MAX_SPLITS}")
    launcher = _Launch(query, key_cache, value_cache, out, scale, num_heads // num_kv_heads,
                       block_size, config or DEFAULT_ATTENTION_CONFIG, sliding_window or 0,
                       softcap or 0.0, sinks)
    if layout is not None:
        launcher.every_sequence(layout)
        return out
    if meta.num_decodes > 0:
        span = _decode_span(meta, block_size)
        if sliding_window:
            span = min(span, -(-sliding_window // block_size) * block_size)
        splits = num_kv_splits or decode_splits(meta.num_decodes, num_kv_heads, span,
                                                target_programs(query.device))
        launcher.decodes(meta, splits)
    if meta.prefill_query_lens:
        launcher.prefills(meta)
    return out


class _Launch:
    """The arguments every launch of one call shares."""

    def __init__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 out: torch.Tensor, scale: float, group: int, block_size: int,
                 config: AttentionLaunchConfig, window: int = 0, softcap: float = 0.0,
                 sinks: torch.Tensor | None = None) -> None:
        self.query, self.key_cache, self.value_cache, self.out = query, key_cache, value_cache, out
        self.window, self.softcap = window, softcap
        # gpt-oss's per-head sink logits, float32 (None: none; the query stands in as the
        # pointer the kernels never read).
        self.sinks = None if sinks is None else sinks.float().contiguous()
        self.group, self.block_size, self.config = group, block_size, config
        self.num_kv_heads, self.head_dim = key_cache.shape[2], key_cache.shape[3]
        self.head_pad = max(16, triton.next_power_of_2(self.head_dim))
        self.scale = scale * _LOG2E
        self.precision = "ieee" if query.dtype == torch.float32 else "tf32"
        # Triton's interpreter multiplies bfloat16 bit patterns in tl.dot (unsupported upstream,
        # triton-lang/triton#11584), so there the operands are upcast after the same rounding;
        # bf16 products are exact in float32, so only the summation order can differ.
        self.upcast = query.dtype == torch.bfloat16 and _interpreting()

    def decodes(self, meta: AttentionMetadata, splits: int) -> None:
        n = meta.num_decodes
        device = self.query.device
        plan = meta.derived.get("triton_decode")
        if plan is None:
            seqs = torch.arange(n, dtype=torch.long, device=device)
            plan = (seqs, torch.zeros_like(seqs), torch.ones_like(seqs))
            meta.derived["triton_decode"] = plan
        seqs, zeros, ones = plan
        tables = meta.decode_block_tables
        # The tables may be wider than the longest context (a static buffer): the kernel reads
        # no column past a row's own context, and sizes each row's splits from it.
        block_m = max(16, triton.next_power_of_2(self.group))
        partial_out = partial_lse = self.out  # unused unless split
        if splits > 1:
            heads = self.num_kv_heads * self.group
            partial_out = torch.empty((n, heads, splits, self.head_pad), dtype=torch.float32,
                                      device=device)
            partial_lse = torch.empty((n, heads, splits), dtype=torch.float32, device=device)
        decode = self.config.decode
        self._run(tables, seqs, zeros, seqs, ones, meta.decode_context_lens, partial_out,
                  partial_lse, block_q=1, block_m=block_m, tile_n=decode.tile_n,
                  splits=splits, num_warps=decode.num_warps, num_stages=decode.num_stages)
        if splits > 1:
            launch(_merge_splits_kernel, (n, self.num_kv_heads * self.group),
                   self.out, partial_out, partial_lse, self._sinks_arg, self.out.stride(0),
                   self.out.stride(1), self.num_kv_heads * self.group, self.head_dim, splits,
                   SPLITS_PAD=MAX_SPLITS, HEAD_PAD=self.head_pad,
                   SINKS=self.sinks is not None)

    def prefills(self, meta: AttentionMetadata) -> None:
        prefill = self.config.prefill
        block_m = max(prefill.block_m, triton.next_power_of_2(self.group))
        block_q = block_m // self.group
        key = f"triton_prefill{block_q}"
        plan = meta.derived.get(key)
        if plan is None:
            plan = _prefill_plan(meta, block_q, self.query.device)
            meta.derived[key] = plan
        # Unsplit: the partial buffers are never read.
        self._run(*plan, self.out, self.out, block_q=block_q, block_m=block_m,
                  tile_n=prefill.tile_n, splits=1, num_warps=prefill.num_warps,
                  num_stages=prefill.num_stages)

    def every_sequence(self, layout: DeviceLayout) -> None:
        """One launch over a captured step's layout: decodes are one-token chunks (no split:
        a mixed step's chunk fills the device anyway), and the grid is the layout's, fixed."""
        prefill = self.config.prefill
        block_m = max(prefill.block_m, triton.next_power_of_2(self.group))
        if layout.block_q != block_m // self.group:
            raise ValueError(f"the layout's tiles hold {layout.block_q} query tokens; this "
                             f"launch's hold {block_m // self.group}")
        self._run(layout.block_tables, layout.tile_seq, layout.tile_offset, layout.query_start,
                  layout.query_len, layout.context_len, self.out, self.out,
                  block_q=layout.block_q, block_m=block_m, tile_n=prefill.tile_n, splits=1,
                  num_warps=prefill.num_warps, num_stages=prefill.num_stages)

    def _run(self, tables: torch.Tensor, tile_seq: torch.Tensor, tile_offset: torch.Tensor,
             query_start: torch.Tensor, query_len: torch.Tensor, context_len: torch.Tensor,
             partial_out: torch.Tensor, partial_lse: torch.Tensor, *,
             block_q: int, block_m: int, tile_n: int, splits: int, num_warps: int,
             num_stages: int) -> None:
        q, cache, out = self.query, self.key_cache, self.out
        grid = (tile_seq.numel(), self.num_kv_heads, splits)
        launch(_paged_attention_kernel, grid,
               out, q, cache, self.value_cache, tables, tile_seq, tile_offset, query_start,
               query_len, context_len, partial_out, partial_lse, self._sinks_arg,
               self.scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
               tables.stride(0), cache.stride(0), cache.stride(1), cache.stride(2), self.head_dim,
               splits, self.window, self.softcap, GROUP=self.group, BLOCK_Q=block_q, BLOCK_M=block_m,
               TILE_N=tile_n, HEAD_PAD=self.head_pad, BLOCK_SIZE=self.block_size,
               SPLIT=splits > 1, DOT_PRECISION=self.precision, DOT_UPCAST=self.upcast,
               SOFTCAP=self.softcap > 0, SINKS=self.sinks is not None,
               num_warps=num_warps, num_stages=num_stages)

    @property
    def _sinks_arg(self) -> torch.Tensor:
        return self.query if self.sinks is None else self.sinks


def layout_block_q(num_heads: int, num_kv_heads: int,
                   config: AttentionLaunchConfig | None = None) -> int:
    """Query tokens per tile of a chunk launch (the rows of a program are tokens x the KV head's
    group of query heads): what a DeviceLayout for these heads must be planned with."""
    group = num_heads // num_kv_heads
    block_m = max((config or DEFAULT_ATTENTION_CONFIG).prefill.block_m,
                  triton.next_power_of_2(group))
    return block_m // group


def _prefill_plan(meta: AttentionMetadata, block_q: int,
                  device: torch.device) -> tuple[torch.Tensor, ...]:
    """Block tables, the tile -> (chunk, first token) map and per-chunk offsets and lengths,
    built once per step (every layer reuses them) from host-side lengths."""
    starts, tile_seq, tile_offset = [], [], []
    start = meta.num_decodes
    for seq, query_len in enumerate(meta.prefill_query_lens):
        starts.append(start)
        for offset in range(0, query_len, block_q):
            tile_seq.append(seq)
            tile_offset.append(offset)
        start += query_len
    # One allocation each: rows of one tensor would be 16-byte aligned or not depending on their
    # length, and Triton compiles a variant per pointer alignment.
    columns = [torch.tensor(values, dtype=torch.long)
               for values in (tile_seq, tile_offset, starts, meta.prefill_query_lens,
                              meta.prefill_context_lens)]
    if device.type == "cuda":
        # Pinned, so the copies are queued behind the step's work instead of waiting for it.
        columns = [c.pin_memory() for c in columns]
    columns = [c.to(device, non_blocking=True) for c in columns]
    tables = padded_block_tables(meta.prefill_block_tables)
    return (tables, *columns)


def _output(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` checked against the query (same shape, dtype and device, unit stride in the last
    dim), or a new tensor."""
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype} on {out.device}; the query is "
                         f"{tuple(query.shape)} {query.dtype} on {query.device}")
    if out.stride(-1) != 1:
        raise ValueError("out must have unit stride in its last dimension")
    return out


def _decode_span(meta: AttentionMetadata, block_size: int) -> int:
    """Keys the decode launch covers: the longest decode context rounded up to whole blocks."""
    return -(-meta.decode_max_context // block_size) * block_size


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def target_programs(device: torch.device) -> int:
    """How many programs a decode launch needs to fill the device: two per multiprocessor on
    CUDA; 1 elsewhere (the interpreter runs programs one by one: splitting only adds a merge)."""
    if device.type != "cuda":
        return 1
    return 2 * _multiprocessor_count(device)


def decode_splits(num_decodes: int, num_kv_heads: int, max_context: int, target: int) -> int:
    """Programs per decode's context: enough for ``target`` programs in all, each split at least
    _MIN_SPLIT_KEYS keys of the longest padded context, at most MAX_SPLITS; a power of two."""
    programs = num_decodes * num_kv_heads
    splits = max(1, min(-(-target // programs), max_context // _MIN_SPLIT_KEYS, MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


def decode_variant_shapes(num_kv_heads: int, block_size: int, max_model_len: int,
                          max_num_seqs: int, target: int) -> dict[bool, tuple[int, int]]:
    """For each decode path the launch can take (split or not: the SPLIT constexpr), one batch
    that takes it, as (number of decodes, context length). ``decode_splits`` grows with the
    context and shrinks with the number of decodes, so the corners of the space the scheduler
    can fill (1..max_num_seqs decodes, contexts 1..max_model_len) reach every path there is."""
    shapes: dict[bool, tuple[int, int]] = {}
    for num_decodes in (1, max_num_seqs):
        for context in (1, max_model_len):
            width = -(-context // block_size)
            split = decode_splits(num_decodes, num_kv_heads, width * block_size, target) > 1
            shapes.setdefault(split, (num_decodes, context))
    return shapes


def is_decode_launch(constants: Mapping[str, Any],
                     config: AttentionLaunchConfig | None = None) -> bool:
    """Whether a recorded launch of the attention kernel (``kernels.variants.Variant``'s
    constants) is a decode launch under ``config`` (default: DEFAULT_ATTENTION_CONFIG). Decodes
    run one token per tile with the decode launch's tile and options; a prefill launch can share
    the tile size, so that alone would not tell them apart (one with the same constants as well
    is the same compiled variant)."""
    decode = (config or DEFAULT_ATTENTION_CONFIG).decode
    return (constants.get("BLOCK_Q") == 1 and constants.get("TILE_N") == decode.tile_n
            and constants.get("num_warps") == decode.num_warps
            and constants.get("num_stages") == decode.num_stages)


_SM_COUNTS: dict[int, int] = {}


def _multiprocessor_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def _check_inputs(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  meta: AttentionMetadata, num_tokens: int, num_heads: int, num_kv_heads: int,
                  head_dim: int, cache_head_dim: int, padded: bool = False) -> None:
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads "
                         f"({num_kv_heads})")
    if cache_head_dim != head_dim or key_cache.shape != value_cache.shape:
        raise ValueError(f"caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)} do not "
                         f"hold head_dim {head_dim}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous")
    if key_cache.dtype != query.dtype:
        raise ValueError(f"cache dtype {key_cache.dtype} differs from the query's {query.dtype}")
    if padded:
        return  # a device layout: its tokens and the padding rows are counted on the device
    covered = meta.num_decodes + sum(meta.prefill_query_lens)
    if covered != num_tokens:
        raise ValueError(f"metadata covers {covered} tokens but the batch has {num_tokens}")
