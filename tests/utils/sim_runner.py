"""A model-free worker for scheduler simulations: it keeps a simulated paged KV cache and
suspended chunks the way workers/model_runner.py does, and can stop a step at a layer.

Every scheduled token is written into the slots its block table names; a sampled token is a
function of the history read back through the block table, so a wrong block id, a stale block
or a bad prefix-cache hit changes the output. Two views of the KV are kept: what any pass wrote
(an unwound one too) and what completed steps wrote, so that a committed prefix-cache hash can be
checked against KV that a completed step really wrote.
"""

from __future__ import annotations

from engine.core.block_pool import BlockPool
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, StepStatus
from engine.core.suspension_ledger import SuspendedChunk
from tests.utils.scheduling import next_token
from workers.block_tables import BlockTables


class SimWorker:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.kv: dict[tuple[int, int], int] = {}
        self.completed_kv: dict[tuple[int, int], int] = {}
        # req_id -> the segments (start_pos, num_tokens, layer) of the chunks whose stopped pass
        # this worker holds, in token order: the first resumes next, maybe in pieces.
        self.suspended: dict[str, list[SuspendedChunk]] = {}
        self.num_frees = 0
        # Each request's block table from the updates steps send, as the workers keep them.
        self.tables = BlockTables(max_blocks=8)

    def execute(self, out: SchedulerOutput, stop_layer: int | None = None) -> ModelRunnerOutput:
        """Runs the step; ``stop_layer``: the vote unwinds it before that layer (only honoured
        on a preemptible step, as the real vote is only taken there)."""
        for req_id in out.free_suspended:
            self.num_frees += req_id in self.suspended
            self.suspended.pop(req_id, None)
        self.tables.release(out.released_req_ids)
        writes: dict[tuple[int, int], int] = {}
        bs = self.block_size
        tables = {r.req_id: self.tables.full_table(r) for r in out.requests}
        for r in out.requests:
            assert r.token_ids, f"{r.req_id}: an empty chunk"
            if r.resume:
                # workers/preemption/suspension.py refuses a resume of other tokens than the first ones of
                # the first segment.
                first = self.suspended.get(r.req_id, [(-1, 0, 0)])[0]
                assert first[0] == r.start_pos and len(r.token_ids) <= first[1], (
                    f"{r.req_id} resumes [{r.start_pos}, +{len(r.token_ids)}) but the worker "
                    f"holds {self.suspended.get(r.req_id)}")
            for i, tok in enumerate(r.token_ids):
                pos = r.start_pos + i
                slot = (tables[r.req_id][pos // bs], pos % bs)
                # A committed block is shared content: nobody may write other tokens into it.
                if self.pool.blocks[slot[0]].block_hash is not None:
                    assert self.kv.get(slot) == tok, f"overwrote committed block {slot[0]}"
                writes[slot] = tok
        self.kv.update(writes)  # an unwound pass has written (some of) its KV too
        if stop_layer is not None and out.preemptible:
            return self._unwind(out, stop_layer)
        self.completed_kv.update(writes)
        sampled: dict[str, int] = {}
        for r in out.requests:
            if r.resume:  # resumed and finished with the step: the rest stays held
                segments = self.suspended[r.req_id]
                segments[:1] = segments[0].tail(len(r.token_ids))
                if not segments:
                    del self.suspended[r.req_id]
            if r.sample:
                end = r.start_pos + len(r.token_ids)
                history = [self.kv[(tables[r.req_id][p // bs], p % bs)] for p in range(end)]
                sampled[r.req_id] = next_token(history)
        return ModelRunnerOutput(step_id=out.step_id, sampled_token_ids=sampled)

    def _unwind(self, out: SchedulerOutput, layer: int) -> ModelRunnerOutput:
        suspended: list[str] = []
        if out.suspend_on_unwind:
            for r in out.requests:
                if len(r.token_ids) < 2:
                    continue  # decodes are never suspended
                held = self.suspended.get(r.req_id) if r.resume else None
                join = held[0][2] if held is not None else 0
                piece = SuspendedChunk(r.start_pos, len(r.token_ids), layer)
                if layer > join:
                    if held is None:
                        self.suspended[r.req_id] = [piece]
                    else:  # a piece that ran past its layer goes ahead of the rest
                        held[:1] = [piece, *held[0].tail(len(r.token_ids))]
                elif held is None:
                    # Stopped before the first layer finished: a fresh chunk has nothing to
                    # keep. A resumed one that had not got past its layer keeps the
                    # activations (and the layer) it had.
                    continue
                suspended.append(r.req_id)
        return ModelRunnerOutput(step_id=out.step_id, status=StepStatus.SLO_PREEMPTED,
                                 slo_preempted_layer=layer, unwound_layers=[layer],
                                 suspended_req_ids=suspended)

    def check_committed_blocks(self, hash_contents: dict[bytes, tuple[int, ...]]) -> None:
        """Every block with a committed hash holds KV written by completed steps, and a hash
        always stands for the same tokens (``hash_contents`` accumulates across calls)."""
        bs = self.block_size
        for block in self.pool.blocks:
            if block.block_hash is None:
                continue
            tokens = []
            for offset in range(bs):
                slot = (block.block_id, offset)
                assert slot in self.completed_kv, (
                    f"block {block.block_id} has a hash but slot {offset} was never written by a "
                    f"completed step")
                assert self.kv[slot] == self.completed_kv[slot], (
                    f"block {block.block_id} has a hash but an unwound pass changed slot {offset}")
                tokens.append(self.completed_kv[slot])
            seen = hash_contents.setdefault(block.block_hash, tuple(tokens))
            assert seen == tuple(tokens), f"block {block.block_id}: one hash, two contents"
