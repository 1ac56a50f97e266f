"""The KV a conversation holds on a Gemma-3-layout model: sliding layers that give back the
blocks their windows passed, against the same model with every layer attending fully.

Builds two small random checkpoints of Gemma 3's text layout (12 layers, five sliding per global
one, window --window), identical but for their layer types, and serves each the same
conversation: turns of --turn-tokens new tokens, each sending the conversation so far and
generating --gen tokens, until it is --windows windows long. After every step it reads the
KV manager: the KV held by the conversation (blocks x the layers a block holds, in layer-blocks)
at its largest, and at the end. Prints both models' figures and their ratio; one JSON line.

    python -m bench.diagnostics.windowed_kv
    python -m bench.diagnostics.windowed_kv --window 1024 --windows 3 --turn-tokens 512
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from engine.benchmarks.inputs.random_checkpoints import make_random_model  # noqa: E402

LAYERS = 12


def _checkpoint(folder: Path, window: int, sliding: bool, max_len: int) -> str:
    layer_types = [("full_attention" if i % 6 == 5 or not sliding else "sliding_attention")
                   for i in range(LAYERS)]
    return make_random_model(folder, "gemma3", seed=0, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=LAYERS, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, vocab_size=512,
                             max_position_embeddings=max_len, sliding_window=window,
                             layer_types=layer_types, initializer_range=0.3)


def _serve(model_dir: str, turns: list[list[int]], gen: int, block: int, budget: int,
           max_len: int) -> dict[str, float]:
    from engine import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", block_size=block, max_model_len=max_len,
              max_num_batched_tokens=budget, enable_prefix_caching=True)
    try:
        scheduler = llm.engine.scheduler
        kv = scheduler.kv_cache_manager
        layers_per_block = len(kv.groups[0].layers)
        most = last = tokens = 0
        update = scheduler.update_from_output

        def observed(scheduler_output, runner_output):
            nonlocal most, last, tokens
            for request in scheduler_output.requests:
                held = kv.num_held_blocks(request.req_id) * layers_per_block
                most, last = max(most, held), held
                tokens = max(tokens, kv.num_blocks_of(request.req_id) * block)
            return update(scheduler_output, runner_output)

        scheduler.update_from_output = observed
        history: list[int] = []
        for new in turns:
            prompt = history + new
            (out,) = llm.generate([{"prompt_token_ids": prompt}],
                                  SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True))
            history = prompt + list(out.token_ids)
        return {"groups": len(kv.groups), "most_layer_blocks": most, "last_layer_blocks": last,
                "tokens": tokens, "prefix_cache_hits": scheduler.stats().prefix_cache_hits}
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--windows", type=float, default=3.0,
                        help="how many windows long the conversation grows")
    parser.add_argument("--turn-tokens", type=int, default=96)
    parser.add_argument("--gen", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    args = parser.parse_args(argv)
    import torch

    target = int(args.windows * args.window)
    turns: list[list[int]] = []
    length, seed = 0, 0
    while length + args.turn_tokens + args.gen <= target:
        g = torch.Generator().manual_seed(seed)
        turns.append(torch.randint(3, 500, (args.turn_tokens,), generator=g).tolist())
        length, seed = length + args.turn_tokens + args.gen, seed + 1
    max_len = 1 << max(10, (target + 64).bit_length())
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for name, sliding in (("sliding", True), ("full", False)):
            model_dir = _checkpoint(Path(root) / name, args.window, sliding, max_len)
            results[name] = _serve(model_dir, turns, args.gen, args.block_size, args.budget,
                                   max_len)
    sliding, full = results["sliding"], results["full"]
    ratio_most = sliding["most_layer_blocks"] / full["most_layer_blocks"]
    ratio_last = sliding["last_layer_blocks"] / full["last_layer_blocks"]
    print(f"Gemma-3 layout ({LAYERS} layers, 5 sliding per global one), window {args.window}, "
          f"{len(turns)} turns of {args.turn_tokens} + {args.gen} tokens: "
          f"{full['tokens']} tokens = {full['tokens'] / args.window:.2f} windows")
    for name, r in results.items():
        print(f"  {name:8s} {r['groups']} KV groups: most held {r['most_layer_blocks']} "
              f"layer-blocks, at the end {r['last_layer_blocks']}; prefix-cache hits "
              f"{r['prefix_cache_hits']} tokens")
    print(f"  sliding / full: most held {ratio_most:.3f}, at the end {ratio_last:.3f}")
    print(json.dumps({"window": args.window, "windows": full["tokens"] / args.window,
                      "sliding": sliding, "full": full, "ratio_most": ratio_most,
                      "ratio_last": ratio_last}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
