"""Drive a model over a paged KV cache by hand, as the model runner would (test helper)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import AttentionMetadata, padded_block_tables
from workers.kv_cache import allocate_kv_caches
from workers.models import DecoderForCausalLM
from workers.preemption.slo_preempt_vote import StepSLOPreempted

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class PagedSequence:
    tokens: list[int]
    blocks: list[int]  # block ids in position order, need not be contiguous
    block_size: int = 16
    num_computed: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)  # one row per computed position

    def slot(self, pos: int) -> int:
        return self.blocks[pos // self.block_size] * self.block_size + pos % self.block_size


def make_kv_caches(model: DecoderForCausalLM, num_blocks: int, block_size: int) -> KVCaches:
    return allocate_kv_caches(model.num_layers, num_blocks, block_size, model.num_kv_heads,
                              model.head_dim, model.dtype, model.device)


def build_metadata(work: list[tuple[PagedSequence, int]],
                   num_decodes: int) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """Metadata, input ids and positions for `work` = [(sequence, tokens to compute)],
    decodes (one token each) first."""
    ids, positions, slots = [], [], []
    for seq, n in work:
        span = range(seq.num_computed, seq.num_computed + n)
        ids += [seq.tokens[p] for p in span]
        positions += list(span)
        slots += [seq.slot(p) for p in span]
    decodes = [seq for seq, _ in work[:num_decodes]]
    prefills = work[num_decodes:]
    tables = padded_block_tables([s.blocks for s in decodes])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        num_decodes=num_decodes,
        decode_block_tables=tables,
        decode_context_lens=torch.tensor([s.num_computed + 1 for s in decodes], dtype=torch.long),
        prefill_query_lens=[n for _, n in prefills],
        prefill_context_lens=[s.num_computed + n for s, n in prefills],
        prefill_block_tables=[torch.tensor(s.blocks, dtype=torch.long) for s, _ in prefills],
    )
    return meta, torch.tensor(ids), torch.tensor(positions)


def paged_step(model: DecoderForCausalLM, kv_caches: KVCaches,
               work: list[tuple[PagedSequence, int]], num_decodes: int) -> None:
    """One forward over `work`; appends every computed position's logits to its sequence (a
    test may look at all of them; the runner only computes the sampled rows)."""
    meta, ids, positions = build_metadata(work, num_decodes)
    hidden = model(ids, positions, meta, kv_caches)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (len(ids), model.vocab_size)
    row = 0
    for seq, n in work:
        seq.logits += list(logits[row:row + n])
        seq.num_computed += n
        row += n


def assert_chunks_match_hf(model: DecoderForCausalLM, model_dir, seq: PagedSequence,
                           chunks: list[int], decodes: int, num_blocks: int, atol: float) -> None:
    """Prefill ``seq`` in ``chunks`` (each over the cached prefix the ones before it left), then
    decode ``decodes`` tokens; every position's logits equal HF transformers' on the whole
    sequence within ``atol``."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([seq.tokens])).logits[0]
    caches = make_kv_caches(model, num_blocks, seq.block_size)
    for n in chunks:
        paged_step(model, caches, [(seq, n)], num_decodes=0)
    for _ in range(decodes):
        paged_step(model, caches, [(seq, 1)], num_decodes=1)
    torch.testing.assert_close(torch.stack(seq.logits), ref, atol=atol, rtol=0)


class StopAt:
    """Stands in for the vote: unwinds the step before the attention op of `layer`."""

    def __init__(self, layer: int | None) -> None:
        self.layer, self.step_id = layer, 0

    def __call__(self, layer: int) -> None:
        if layer == self.layer:
            raise StepSLOPreempted(self.step_id, layer)

    def finish(self) -> None:
        pass


def bypass_the_position_buffer(monkeypatch) -> None:
    """Make every step's positions a fresh tensor instead of the runner's position buffer: a
    captured graph keeps reading the buffer (stale positions), so its tokens change (the probe
    that replays really go through the static buffers)."""
    from workers.step_buffers import StepBuffers

    upload = StepBuffers.upload

    def stale_positions(buffers: StepBuffers, buffer: torch.Tensor,
                        host: torch.Tensor) -> torch.Tensor:
        if buffer is buffers.positions:
            return host.clone()
        return upload(buffers, buffer, host)

    monkeypatch.setattr(StepBuffers, "upload", stale_positions)
