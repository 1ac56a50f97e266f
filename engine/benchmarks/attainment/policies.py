"""The scheduling policies the TTFT-attainment benchmark compares, as engine arguments and as
`sloserve serve` flags (so the in-process and HTTP runners run exactly the same engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The policy a running `sloserve serve` runs unless told otherwise (the engine's default:
# slack-EDF with mid-forward preemption in suspend mode): what `--url` and a fleet's replicas run.
DEFAULT_SERVER_POLICY = "slo+mf-conservative-suspend"


@dataclass(frozen=True)
class PolicySpec:
    name: str
    scheduling_policy: str
    mid_forward: bool = False
    slo_preempt_policy: str = "conservative"
    slo_preempt_mode: str = "pause"

    def engine_kwargs(self) -> dict[str, Any]:
        return dict(scheduling_policy=self.scheduling_policy,
                    slo_preemption=self.mid_forward,
                    slo_preempt_policy=self.slo_preempt_policy,
                    slo_preempt_mode=self.slo_preempt_mode)

    def serve_args(self) -> list[str]:
        return ["--scheduling-policy", self.scheduling_policy,
                "--slo-preemption", "on" if self.mid_forward else "off",
                "--slo-preempt-policy", self.slo_preempt_policy,
                "--slo-preempt-mode", self.slo_preempt_mode]

    @property
    def uses_tier_priority(self) -> bool:
        return self.scheduling_policy == "priority"


def _mid_forward(gate: str, mode: str) -> PolicySpec:
    return PolicySpec(f"slo+mf-{gate}-{mode}", "slo", True, gate, mode)


POLICIES: dict[str, PolicySpec] = {p.name: p for p in [
    PolicySpec("fcfs", "fcfs"),  # vLLM's default
    PolicySpec("priority", "priority"),  # the tier as priority, as vLLM's priority policy
    PolicySpec("slo", "slo"),  # step-level slack-EDF, mid-forward preemption off
    _mid_forward("conservative", "pause"),
    _mid_forward("conservative", "recompute"),
    _mid_forward("conservative", "suspend"),
    _mid_forward("aggressive", "pause"),
    _mid_forward("aggressive", "recompute"),
    _mid_forward("aggressive", "suspend"),
]}

# fcfs (vLLM's default), slack-EDF at step level, and sloserve's default: slack-EDF with
# mid-forward preemption in suspend mode.
DEFAULT_SWEEP_POLICIES = ["fcfs", "slo", "slo+mf-conservative-suspend"]


def resolve_policies(names: list[str]) -> list[PolicySpec]:
    if names == ["all"]:
        return list(POLICIES.values())
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {', '.join(POLICIES)} or all")
    return [POLICIES[n] for n in names]


def tier_priorities(slos_by_tier: dict[str, list[float | None]]) -> dict[str, int]:
    """Tier -> vLLM-style priority (lower runs first): tiers with tighter median SLOs first,
    tiers without SLOs last."""
    def key(tier: str) -> float:
        slos = sorted(s for s in slos_by_tier[tier] if s is not None)
        return slos[len(slos) // 2] if slos else float("inf")

    return {tier: rank for rank, tier in enumerate(sorted(slos_by_tier, key=key))}
