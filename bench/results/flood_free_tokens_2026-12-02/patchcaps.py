import time
from engine.core import deadline_caps as dc
from engine.core import slack_policy as sp
_jb = dc.DeadlineCaps.join_budget
def jb(self, step, request):
    r = _jb(self, step, request)
    line = self._predictor.current
    print(f"   join_budget {request.request_id} -> {r} (budget {step.budget}, with_deadline {list(step.with_deadline)}, err {line.relative_error:.2f})")
    return r
dc.DeadlineCaps.join_budget = jb
_ct = dc.DeadlineCaps.cap_for_tpot
def ct(self, requests, step):
    r = _ct(self, requests, step)
    print(f"   cap_for_tpot -> {r} decodes {[x.request_id for x in self.tpot_decodes(requests, step)]}")
    return r
dc.DeadlineCaps.cap_for_tpot = ct
from engine.runtime import engine_core as ec
_obs = ec.observe_step
def obs(predictor, so, ro, *a, **k):
    r = _obs(predictor, so, ro, *a, **k)
    m = predictor.current
    print(f"   after step {so.step_id}: err {m.relative_error:.2f} conf {m.confident} floor {m.floor_s*1e3:.1f} ms tok {m.seconds_per_token*1e6:.1f} us int {m.intercept_s*1e3:.2f} resid {[round(x,2) for x in list(predictor._residuals)[-4:]]}")
    return r
ec.observe_step = obs
