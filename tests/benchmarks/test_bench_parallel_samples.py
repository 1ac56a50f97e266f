"""bench/diagnostics/parallel_samples.py: n samples computed through the gate, at once, and without the
prefix cache, on a tiny model."""

import json

from bench.diagnostics.parallel_samples import main


def test_the_gate_computes_the_prompt_once(tiny_model, capsys):
    assert main(["--model", tiny_model("llama"), "--dtype", "float32", "--prompt-len", "96",
                 "-n", "4", "--max-tokens", "3", "--max-num-batched-tokens", "512"]) == 0
    report = json.loads(capsys.readouterr().out)
    gated, together, uncached = report["gated"], report["together"], report["no-cache"]
    # Gated: one prefill, the later samples recompute only the last partial block (16 tokens
    # of block size 16: 95 // 16 = 5 blocks hit), then 2 decodes each.
    assert gated["computed_tokens"] == 96 + 3 * 16 + 4 * 2
    # Submitted together within one token budget: every sample prefills the whole prompt.
    assert together["computed_tokens"] == uncached["computed_tokens"] == 4 * 96 + 4 * 2
    assert together["computed_tokens_vs_gated"] > 2
