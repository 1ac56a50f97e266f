"""Tensor-parallel shard math: two gloo ranks, each holding its shard of a tiny model, must
produce HF's logits (float32) through the paged forward pass."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from tests.utils.paged_helpers import PagedSequence, make_kv_caches, paged_step  # noqa: E402
from tests.utils.tiny_models import make_tiny_model  # noqa: E402
from workers.distributed import destroy, init_distributed  # noqa: E402
from workers.models import build_model  # noqa: E402
from workers.startup.weight_loader import load_weights  # noqa: E402

TP_SIZE = 2
# Sharded KV heads; replicated KV heads (1 KV head, 2 ranks) with a vocabulary that does not
# split evenly; biases on the row-parallel layers (added once, after the all-reduce); q/k norms.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-biases": ("llama", {"tie_word_embeddings": False, "attention_bias": True,
                               "mlp_bias": True}),
    "qwen2-kv-replicated": ("qwen2", {"num_key_value_heads": 1, "vocab_size": 501}),
    "qwen3": ("qwen3", {}),
}


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run_rank(rank: int, model_dirs: list[str], out_dir: str) -> None:
    torch.set_num_threads(1)
    # As the workers join: workers.distributed's set-up is what lets the group go at destroy.
    groups = init_distributed(rank, TP_SIZE, f"file://{out_dir}/store", torch.device("cpu"),
                              timeout_s=120)
    try:
        for model_dir in model_dirs:
            config = AutoConfig.from_pretrained(model_dir)
            model = build_model(config, torch.float32, torch.device("cpu"), tp_rank=rank,
                                tp_size=TP_SIZE, tp_group=groups.tensor_group)
            load_weights(model, model_dir)
            kv_caches = make_kv_caches(model, num_blocks=16, block_size=16)
            a = PagedSequence(_tokens(50, config.vocab_size, 1), blocks=[7, 2, 11, 4])
            b = PagedSequence(_tokens(20, config.vocab_size, 2), blocks=[9, 0])
            paged_step(model, kv_caches, [(a, 30), (b, 19)], num_decodes=0)
            paged_step(model, kv_caches, [(b, 1), (a, 20)], num_decodes=1)
            torch.save({"a": torch.stack(a.logits), "b": torch.stack(b.logits)},
                       f"{model_dir}/logits_rank{rank}.pt")
    finally:
        destroy(groups)


def test_two_rank_tensor_parallel_matches_hf(tmp_path: Path) -> None:
    model_dirs = [make_tiny_model(tmp_path / name, arch, **overrides)
                  for name, (arch, overrides) in VARIANTS.items()]
    mp.spawn(_run_rank, args=(model_dirs, str(tmp_path)), nprocs=TP_SIZE, join=True)
    for model_dir in model_dirs:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        vocab = hf.config.vocab_size
        with torch.no_grad():
            ref_a = hf(torch.tensor([_tokens(50, vocab, 1)])).logits[0]
            ref_b = hf(torch.tensor([_tokens(20, vocab, 2)])).logits[0]
        for rank in range(TP_SIZE):  # every rank holds the full, gathered logits
            got = torch.load(f"{model_dir}/logits_rank{rank}.pt")
            torch.testing.assert_close(got["a"], ref_a, atol=2e-4, rtol=0, msg=model_dir)
            torch.testing.assert_close(got["b"], ref_b, atol=2e-4, rtol=0, msg=model_dir)
