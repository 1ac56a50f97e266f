"""bench/diagnostics/step_model.py: records the engine's steps as its online model sees them, and scores
the model with and without the decode term on held-out steps."""

from bench.diagnostics.step_model import errors, fit_variants, kind_of, record_steps
from monitor.step_time_model import StepTimeModel

TRUE = StepTimeModel(seconds_per_token=2e-3, intercept_s=0.05, seconds_per_decode_context=3e-5)


def _step(tokens: int, prefill: int, context: int, decodes: int):
    seconds = TRUE.predict_step(tokens, prefill * prefill, context)
    return (tokens, prefill * prefill, context, decodes, seconds)


def test_the_decode_term_predicts_decodes_over_long_contexts_and_the_old_model_does_not():
    steps = [_step(n + d, n, d * ctx, d) for n in (0, 128, 512) for d in (0, 1, 8)
             for ctx in (64, 1024, 2048) if n + d > 0]
    assert {kind_of(s) for s in steps} == {"prefill-only", "mixed", "decode-only"}
    models = fit_variants(steps, quadratic=False)
    new = errors(models["decode-term"], "decode-term", steps)
    old = errors(models["prefill-only"], "prefill-only", steps)
    assert new["decode-only"]["p90_abs_rel_error"] < 1e-6
    assert old["decode-only"]["p90_abs_rel_error"] > 0.2


def test_record_steps_sees_every_kind_of_step(tiny_model):
    steps = record_steps(tiny_model("llama"), num_requests=4, budget=64, seed=0)
    kinds = {kind_of(s) for s in steps}
    assert kinds == {"prefill-only", "mixed", "decode-only"}, kinds
    assert all(seconds > 0 for *_, seconds in steps)
    assert all(context > 0 for _, _, context, decodes, _ in steps if decodes)
