"""Seeded random-weight checkpoints in Hugging Face format, and a small BPE tokenizer for them.

The tests build tiny ones; `bench/suite/gpu_equality.py` builds mid-size ones for greedy
equality against HF transformers on a GPU. Nothing is fetched: the weights are drawn by transformers' own
classes, the tokenizer is trained on a few sentences.

Random models have near-uniform logits, which makes greedy argmax flip under harmless float32
summation-order changes. Callers therefore pass a large ``initializer_range`` so each position's
top-1 logit leads the runner-up by a clear margin.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import transformers

# arch -> (config class name, model class name, tie_word_embeddings, extra config)
ARCHS: dict[str, tuple[str, str, bool, dict[str, Any]]] = {
    # Tied like SmolLM2 (the default model); Llama's config default is untied.
    "llama": ("LlamaConfig", "LlamaForCausalLM", True, {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", False, {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", True, {}),
    # Explicit head_dim larger than hidden / heads, as real Qwen3 checkpoints have.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", True, {"head_dim": 32}),
    # Mixtures of experts: 8 experts, 2 per token, each narrower than a dense MLP. Qwen3-MoE
    # renormalises the top-k weights as the released checkpoints do (norm_topk_prob true);
    # Qwen2-MoE keeps its config's default (false) and adds its shared expert.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", False,
                  {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 48, "norm_topk_prob": True}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", True,
                  {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                   "shared_expert_intermediate_size": 96}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", False,
                {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None}),
    # Gemma 3's text model: q/k norms, four norms a layer, GeGLU, scaled embeddings, and its
    # sliding / global layer pattern (every second layer global at the tiny models' depth).
    # Phi-3: q/k/v and gate/up stored fused; Phi3Config's default pad and eos ids (32000) are
    # past a tiny vocabulary.
    "phi3": ("Phi3Config", "Phi3ForCausalLM", False,
             {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # Gemma 2: every other layer sliding; its soft-caps lowered to where a tiny model's scores
    # and logits reach (the released 50 and 30 would barely bend them).
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", True,
               {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 24,
                "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0}),
    # gpt-oss: 4 experts, 2 per token, every other layer sliding over 24 tokens (its YaRN
    # rotary and its head_dim of 64 as released would be the defaults).
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", False,
                {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                 "sliding_window": 24, "pad_token_id": 0, "eos_token_id": 2}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", True,
               {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 24,
                "sliding_window_pattern": 2}),
}

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Deadlines matter: an interactive turn must start within half a second.",
    "Ünïcödé text, emoji 🙂 and numbers 12345 exercise multi-byte decoding.",
] * 20


def save_small_tokenizer(path: str | os.PathLike[str], vocab_size: int = 400) -> Path:
    """A byte-level BPE tokenizer trained here (``<eos>`` its only special token), saved to
    ``path`` in transformers' format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # show_progress=False: the trainer's progress bar writes blank lines to stdout, which a
    # bench's stdout (the device throughput benchmark's markdown table) must not carry.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.save_pretrained(str(path))
    return Path(path)


def make_config(arch: str, **config: Any) -> Any:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHS)}")
    config_name, _, tie, extra = ARCHS[arch]
    return getattr(transformers, config_name)(**{"tie_word_embeddings": tie, **extra, **config})


def make_random_model(path: str | os.PathLike[str], arch: str = "llama", seed: int = 0,
                      **config: Any) -> str:
    """Save a seeded random ``arch`` model (config.json + model.safetensors, float32) to
    ``path`` and return the path. Keyword arguments are config fields."""
    hf_config = make_config(arch, **config)
    model_class = getattr(transformers, ARCHS[arch][1])
    torch.manual_seed(seed)
    model = model_class(hf_config).to(torch.float32)  # init uses config.initializer_range
    with torch.no_grad():
        # Norm weights init to 1 and biases to 0; jitter them so a loader that skipped them
        # (or mixed up which is which) shows up as a logit mismatch.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    return str(path)


# A small mixture of experts of Qwen3-MoE's layout (q/k norms, top-k routing renormalised, no
# shared expert) at a size a CPU serves: 8 layers, 32 experts of which each token takes 4, about
# 0.4B parameters with the default model's 49152-token vocabulary (0.1B of them the embedding and
# head). For CPU benchmarks of the MoE path against HF transformers, not for output quality.
SMALL_MOE: dict[str, Any] = dict(
    hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
    head_dim=64, moe_intermediate_size=384, intermediate_size=2048, num_experts=32,
    num_experts_per_tok=4, max_position_embeddings=4096, rms_norm_eps=1e-6,
    initializer_range=0.02)


def small_moe(path: str | os.PathLike[str], tokenizer_from: str | os.PathLike[str],
              seed: int = 0) -> str:
    """A seeded random ``SMALL_MOE`` checkpoint (bfloat16, as released MoE checkpoints are) with
    the tokenizer files of ``tokenizer_from``, at ``path``; returns the path."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_from))
    hf_config = make_config("qwen3_moe", **{**SMALL_MOE, "vocab_size": len(tokenizer)})
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(hf_config).to(torch.bfloat16)
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


def random_with_heads(path: str | os.PathLike[str], like: str, num_heads: int,
                      num_kv_heads: int) -> str:
    """A seeded random-weight copy (bfloat16) of the model at ``like`` with another head count
    (the default model's 9 heads cannot be split over 2 ranks): for measuring tensor-parallel
    overhead, not output quality. Returns the path."""
    config = transformers.AutoConfig.from_pretrained(like)
    config.num_attention_heads, config.num_key_value_heads = num_heads, num_kv_heads
    config.head_dim = config.hidden_size // num_heads
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(
        str(path))
    return str(path)
