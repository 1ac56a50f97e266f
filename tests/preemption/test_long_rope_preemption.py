"""Mid-forward preemption of a LongRoPE model (Phi-4-mini's layout): the long prompt (400
tokens) is past the threshold and rotates by the long factors, the urgent one by the short;
the scenario of tests/preemption/test_mid_forward_preemption.py (an urgent arrival unwinds the
long prefill, its chunk suspended and resumed at its layer; greedy outputs equal an unpreempted
run's), where the resumed pass must keep the long regime's rotation."""

from __future__ import annotations

from transformers import AutoConfig

from engine.core.long_rope import long_rope_threshold
from engine.core.scheduler import Scheduler
from tests.utils.mid_forward import (LONG_PROMPT, LONG_ROPE_AFTER,
                                     check_urgent_arrival_unwinds_long_prefill)


def test_urgent_arrival_unwinds_a_long_regime_prefill(long_rope_model: str,
                                                      monkeypatch) -> None:
    assert long_rope_threshold(AutoConfig.from_pretrained(long_rope_model)) == LONG_ROPE_AFTER
    regimes: dict[str, bool] = {}
    choose = Scheduler._choose_rope_regime

    def recorded(self, request) -> None:
        choose(self, request)
        regimes[request.request_id] = request.long_rope

    monkeypatch.setattr(Scheduler, "_choose_rope_regime", recorded)
    check_urgent_arrival_unwinds_long_prefill(long_rope_model, "suspend")
    # Probe: the long prompt ran in the long regime, the urgent one (44 tokens) in the short.
    assert 44 < LONG_ROPE_AFTER < LONG_PROMPT
    assert regimes == {"long": True, "urgent": False}
