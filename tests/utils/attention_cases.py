"""Paged-attention test cases: requests with random K/V scattered over a paged cache, the step's
metadata, and a float64 dense reference (shared by the PyTorch and Triton kernel tests)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kernels import AttentionMetadata, padded_block_tables
from kernels import torch_attention

NUM_BLOCKS = 64

# (num_cached, num_new): decodes first (num_new == 1), then prefill chunks. Prefixes are not
# multiples of the block size; one chunk has no prefix, one is a single token after a prefix.
MIXED = [(0, 1), (16, 1), (40, 1), (77, 1), (130, 1),
         (0, 23), (37, 50), (5, 1), (64, 16), (100, 9)]
MIXED_DECODES = 5


@dataclass
class Request:
    num_cached: int  # tokens whose K/V are already in the cache
    num_new: int  # tokens computed this step
    keys: torch.Tensor  # [num_cached + num_new, Hkv, D], the whole context
    values: torch.Tensor
    blocks: list[int]


@dataclass
class Case:
    """One step: the query, this step's new K/V (already written to the caches), the metadata."""

    requests: list[Request]
    query: torch.Tensor
    new_keys: torch.Tensor
    new_values: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float

    def dense_reference(self, sliding_window: int | None = None,
                        softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
        return dense_reference(self.query.cpu(), self.requests, self.scale, sliding_window,
                               softcap, sinks)

    def to(self, device: torch.device | str) -> Case:
        """The same step with its tensors on ``device`` (the requests stay on the CPU for the
        dense reference); itself on the device it is on."""
        if torch.device(device) == self.query.device:
            return self
        meta = self.meta
        moved = AttentionMetadata(
            slot_mapping=meta.slot_mapping.to(device), num_decodes=meta.num_decodes,
            decode_block_tables=meta.decode_block_tables.to(device),
            decode_context_lens=meta.decode_context_lens.to(device),
            prefill_query_lens=list(meta.prefill_query_lens),
            prefill_context_lens=list(meta.prefill_context_lens),
            prefill_block_tables=[t.to(device) for t in meta.prefill_block_tables])
        return dataclasses.replace(
            self, query=self.query.to(device), new_keys=self.new_keys.to(device),
            new_values=self.new_values.to(device), key_cache=self.key_cache.to(device),
            value_cache=self.value_cache.to(device), meta=moved)


def make_requests(specs: list[tuple[int, int]], num_kv_heads: int, head_dim: int,
                  block_size: int, dtype: torch.dtype, gen: torch.Generator,
                  num_blocks: int = NUM_BLOCKS) -> list[Request]:
    free = torch.randperm(num_blocks, generator=gen).tolist()  # non-contiguous block ids
    requests = []
    for num_cached, num_new in specs:
        ctx = num_cached + num_new
        n_blocks = -(-ctx // block_size)
        blocks, free = free[:n_blocks], free[n_blocks:]
        keys = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        values = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        requests.append(Request(num_cached, num_new, keys, values, blocks))
    return requests


def slots(req: Request, positions: range, block_size: int) -> list[int]:
    return [req.blocks[p // block_size] * block_size + p % block_size for p in positions]


def build_step(requests: list[Request], num_decodes: int,
               block_size: int) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """Metadata plus this step's new K/V, flattened in batch order."""
    slot_mapping: list[int] = []
    for req in requests:
        slot_mapping += slots(req, range(req.num_cached, req.num_cached + req.num_new),
                              block_size)
    decodes, prefills = requests[:num_decodes], requests[num_decodes:]
    # Extra padding columns: the kernels must stop at each context's end.
    tables = padded_block_tables([r.blocks for r in decodes], extra_columns=2)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
        num_decodes=num_decodes,
        decode_block_tables=tables,
        decode_context_lens=torch.tensor([r.num_cached + 1 for r in decodes], dtype=torch.long),
        prefill_query_lens=[r.num_new for r in prefills],
        prefill_context_lens=[r.num_cached + r.num_new for r in prefills],
        prefill_block_tables=[torch.tensor(r.blocks, dtype=torch.long) for r in prefills],
    )
    new_keys = torch.cat([r.keys[r.num_cached:] for r in requests])
    new_values = torch.cat([r.values[r.num_cached:] for r in requests])
    return meta, new_keys, new_values


def write_prefixes(requests: list[Request], key_cache: torch.Tensor,
                   value_cache: torch.Tensor, block_size: int) -> None:
    """The cached prefixes, as earlier steps would have left them."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    for req in requests:
        idx = torch.tensor(slots(req, range(req.num_cached), block_size), dtype=torch.long)
        key_cache.view(-1, num_kv_heads, head_dim)[idx] = req.keys[:req.num_cached]
        value_cache.view(-1, num_kv_heads, head_dim)[idx] = req.values[:req.num_cached]


def dense_reference(query: torch.Tensor, requests: list[Request], scale: float,
                    sliding_window: int | None = None,
                    softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """float64 attention from each request's full K/V, query i at position num_cached + i
    (with a sliding window W: over the keys after its position - W, as HF masks; with a
    softcap c: scores c * tanh(scores / c), as Gemma 2's; with sinks: each head's logit as
    one more column of the softmax, dropped after it, as gpt-oss's eager attention)."""
    outs = []
    start = 0
    for req in requests:
        q = query[start:start + req.num_new].double()
        group = q.shape[1] // req.keys.shape[1]
        k = req.keys.double().repeat_interleave(group, dim=1)
        v = req.values.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(req.num_cached, req.num_cached + req.num_new)
        keys = torch.arange(k.shape[0])[None, :]
        visible = keys <= q_pos[:, None]
        if sliding_window is not None:
            visible &= keys > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            column = sinks.double().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
            probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
        start += req.num_new
    return torch.cat(outs)


def make_case(specs: list[tuple[int, int]], num_decodes: int, num_heads: int,
              num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
              seed: int = 0, num_blocks: int = NUM_BLOCKS) -> Case:
    gen = torch.Generator().manual_seed(seed)
    requests = make_requests(specs, num_kv_heads, head_dim, block_size, dtype, gen, num_blocks)
    # Stale values everywhere: any slot the kernel reads by mistake changes the result.
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    write_prefixes(requests, key_cache, value_cache, block_size)
    meta, new_keys, new_values = build_step(requests, num_decodes, block_size)
    query = torch.randn(new_keys.shape[0], num_heads, head_dim, generator=gen).to(dtype)
    torch_attention.write_kv_cache(new_keys, new_values, key_cache, value_cache,
                                   meta.slot_mapping)
    return Case(requests, query, new_keys, new_values, key_cache, value_cache, meta,
                head_dim ** -0.5)
