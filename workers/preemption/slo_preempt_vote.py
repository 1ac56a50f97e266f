"""The attention-op vote (docs/design.md section 4): stop a preemptible step between two layers.

Before each attention op: local vote = (target step id == this step's id) and
(layer / num_layers x discarded share <= stubborn_fraction) (Rule 2: a step nearly done is not
thrown away). The discarded share is the part of the step's tokens an unwind would throw away:
all of them, except in suspend mode, where every prefill chunk resumes at the stopped layer and
only the decodes' partial layers are lost. With TP, the ranks agree by all_reduce(MAX)
over the CPU (gloo) group, and raise only after the collective returned, so no rank is left
waiting in a collective the others skipped. A rank that cannot see the signal (another node)
votes 0 and learns the decision from the all_reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.core.scheduler_output import SchedulerOutput
from monitor.slo_preempt_signal import SLOPreemptSignal


class StepSLOPreempted(Exception):
    """Raised inside the forward pass to unwind it; never crosses a process boundary."""

    def __init__(self, step_id: int, layer: int) -> None:
        super().__init__(f"step {step_id} preempted before layer {layer}")
        self.step_id, self.layer = step_id, layer
        # Set by the model as the exception passes: the stopped layer's inputs (rows of the
        # tokens active there; residual is None at layer 0), for suspending the pass.
        self.hidden_states: torch.Tensor | None = None
        self.residual: torch.Tensor | None = None


@dataclass
class VoteStats:
    collectives: int = 0


class SLOPreemptVote:
    """Called before every attention op of a preemptible step (`model.before_attention`).

    TP=1: the local vote decides at once. TP>1: the ballot of layer L is an asynchronous
    all_reduce(MAX) over the CPU group that runs while layer L computes; every rank waits for it
    at the boundary of layer L+1 and raises there, only after the collective returned. A
    synchronous collective per layer would make every rank wait for the slowest one at each
    boundary (measured 2 ms per layer with gloo, 3-4% of a 1024-token prefill at TP=2); overlapped,
    it costs its launch, for one layer more of unwind latency. Past the stubborn fraction no rank
    starts a ballot at all (all ranks agree on that without talking: they run the same step).
    """

    def __init__(self, signal: SLOPreemptSignal | None, num_layers: int,
                 stubborn_fraction: float = 0.9,
                 cpu_group: dist.ProcessGroup | None = None) -> None:
        if not 0.0 <= stubborn_fraction <= 1.0:
            raise ValueError(f"stubborn_fraction must be in [0, 1], got {stubborn_fraction}")
        self.signal = signal
        self.num_layers = num_layers
        self.stubborn_fraction = stubborn_fraction
        self.cpu_group = cpu_group
        self.step_id = -1
        # Set with step_id for every preemptible step (see the module docstring).
        self.discarded_share = 1.0
        # Layers the device may still be behind the host when the vote is cast (the run-ahead
        # window on a GPU, workers/preemption/run_ahead.py): the progress reported to the monitor is what
        # the device finished, not what the host has launched.
        self.progress_lag = 0
        self.stats = VoteStats()
        self._ballot = torch.zeros(1, dtype=torch.int64)
        self._pending: dist.Work | None = None

    def _local_vote(self, layer: int) -> bool:
        return (self.signal is not None and self.signal.target_step_id == self.step_id
                and self._within_stubborn_fraction(layer))

    def _within_stubborn_fraction(self, layer: int) -> bool:
        return layer / self.num_layers * self.discarded_share <= self.stubborn_fraction

    def __call__(self, layer: int) -> None:
        if self.signal is not None:
            # How far the step got: the monitor's estimate of the time it has left.
            self.signal.report_progress(self.step_id, max(0, layer - self.progress_lag))
        if self.cpu_group is None:
            if self._local_vote(layer):
                raise StepSLOPreempted(self.step_id, layer)
            return
        if self._pending is not None:
            stop = self._collect()
            if stop:
                raise StepSLOPreempted(self.step_id, layer)
        if self._within_stubborn_fraction(layer):
            self._ballot[0] = int(self._local_vote(layer))
            self._pending = dist.all_reduce(self._ballot, op=dist.ReduceOp.MAX,
                                            group=self.cpu_group, async_op=True)
            self.stats.collectives += 1

    def _collect(self) -> bool:
        assert self._pending is not None
        self._pending.wait()
        self._pending = None
        return bool(self._ballot[0])

    def finish(self) -> None:
        """After a completed forward pass: wait for a ballot still in flight, so that no
        collective of this step overlaps the next one's (its outcome no longer matters: the
        step is done)."""
        if self._pending is not None:
            self._collect()


def discarded_share(scheduler_output: SchedulerOutput) -> float:
    """The share of a step's tokens an unwind throws away (Rule 2): in suspend mode only the
    decodes', since every prefill chunk resumes where it stopped."""
    if not scheduler_output.suspend_on_unwind:
        return 1.0
    tokens = [len(r.token_ids) for r in scheduler_output.requests]
    return sum(n for n in tokens if n == 1) / max(1, sum(tokens))
