"""How much of the running step is left, from the layers the device has finished.

The necessity test (monitor.policy.choose_slo_preemption) lets a waiter wait out the running step
only if its slack covers the rest of that step. The predictor's whole-step estimate alone is not
enough at GPU time scales (a 24k-token step takes 1.2 s and a predictor can be off by 2x), so the
step's own pace is measured: the vote reports at every attention op how many layers the device
has finished and when (monitor.slo_preempt_signal).

Layers are not equal: a chunk resuming a suspended pass joins at the layer it stopped at, so the
layers below carry only the fresh chunks. `predicted_layer_ends` gives the predicted time at
every layer boundary from the chunks and their join layers; the pace is the measured time of the
finished layers over their predicted time, and the rest is the predicted time of the layers left
times that pace, never less than predicted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from monitor.step_point import attention_work, decode_context

# (tokens, attention, decode_context) -> predicted seconds of the whole step.
StepPredictor = Callable[[int, int, int], float]


def predicted_layer_ends(predict_step: StepPredictor, chunks: Sequence[tuple[int, int, int]],
                         num_layers: int) -> tuple[float, ...]:
    """Predicted seconds from the step's start until each layer boundary: element `l` is the
    time by which the layers before `l` are done (0 up to the step's first layer), the last one
    the whole step. `chunks`: (prefix, num_tokens, join_layer) of every scheduled chunk (join 0
    for all but resumed ones)."""
    ends = [0.0]
    share_by_join: dict[int, float] = {}
    for layer in range(num_layers):
        active = [(prefix, n) for prefix, n, join in chunks if join <= layer]
        key = len(active)  # the active set only grows with the layer: its size names it
        if key not in share_by_join:
            share_by_join[key] = (predict_step(sum(n for _, n in active), attention_work(active),
                                               decode_context(active)) / num_layers
                                  if active else 0.0)
        ends.append(ends[-1] + share_by_join[key])
    return tuple(ends)


def remaining_seconds(layer_ends: Sequence[float], layers_done: int, reported_at: float,
                      started_at: float) -> float:
    """The step's time left: the predicted time of the layers not done, scaled by the pace of
    the ones done (measured time / predicted time, at least 1). Before the device reports a
    finished layer of this step, the whole predicted step is left."""
    total = layer_ends[-1]
    done = layer_ends[min(layers_done, len(layer_ends) - 1)]
    if done <= 0:
        return total
    pace = max(1.0, (reported_at - started_at) / done)
    return (total - done) * pace
