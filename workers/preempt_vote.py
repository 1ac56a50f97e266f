"""The attention-op vote (DESIGN.md section 4): stop a preemptible step between two layers.

Before each attention op: local vote = (target step id == this step's id) and
(layer / num_layers <= stubborn_fraction) (Rule 2). With TP, the ranks agree by all_reduce(MAX)
over the CPU (gloo) group, and raise only after the collective returned, so no rank is left
waiting in a collective the others skipped. A rank that cannot see the signal (another node)
votes 0 and learns the decision from the all_reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from monitor.preempt_signal import PreemptSignal


class StepPreempted(Exception):
    """Raised inside the forward pass to unwind it; never crosses a process boundary."""

    def __init__(self, step_id: int, layer: int) -> None:
        super().__init__(f"step {step_id} preempted before layer {layer}")
        self.step_id, self.layer = step_id, layer


@dataclass
class VoteStats:
    collectives: int = 0


class PreemptVote:
    def __init__(self, signal: PreemptSignal | None, num_layers: int,
                 stubborn_fraction: float = 0.9,
                 cpu_group: dist.ProcessGroup | None = None) -> None:
        if not 0.0 <= stubborn_fraction <= 1.0:
            raise ValueError(f"stubborn_fraction must be in [0, 1], got {stubborn_fraction}")
        self.signal = signal
        self.num_layers = num_layers
        self.stubborn_fraction = stubborn_fraction
        self.cpu_group = cpu_group
        self.step_id = -1
        self.stats = VoteStats()
        self._ballot = torch.zeros(1, dtype=torch.int64)

    def __call__(self, layer: int) -> None:
        local = (self.signal is not None and self.signal.target_step_id == self.step_id
                 and layer / self.num_layers <= self.stubborn_fraction)
        if self.cpu_group is None:
            stop = local
        else:
            self._ballot[0] = int(local)
            dist.all_reduce(self._ballot, op=dist.ReduceOp.MAX, group=self.cpu_group)
            self.stats.collectives += 1
            stop = bool(self._ballot[0])
        if stop:
            raise StepPreempted(self.step_id, layer)
