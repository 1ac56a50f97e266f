"""Model folders of real shapes without their weights, for `--load-format dummy` runs.

A Llama-3.1-8B checkpoint is 16 GB: too big to carry to an air-gapped GPU machine or to download there. The
engine's kernels, vote and preemption timings depend on the shape alone, so a folder holding the
shape's config.json and a tokenizer is enough; `--load-format dummy` then draws the weights on
the device.

    sloserve bench shape llama-3.1-8b /tmp/llama-8b-shape
    sloserve serve /tmp/llama-8b-shape --load-format dummy --device cuda

Shapes: llama-3.2-1b, llama-3.1-8b, qwen2.5-7b (dense); qwen3-30b-a3b and mixtral-8x7b
(mixture of experts); llama-3.1-8b-fp8 (the 8B with block-wise FP8 weights); gemma-3-12b
(Gemma 3's text model: sliding and global layers); phi-4-mini (partial rotary, LongRoPE);
gpt-oss-20b (attention sinks, sliding layers, 32 experts; in bf16, as its MXFP4 experts load).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import string
from pathlib import Path
from typing import Any

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

# Block-wise FP8 as the FP8 checkpoints users download hold it: e4m3 weights with one float32
# scale per 128x128 block, activations quantized per step ("dynamic").
_FP8_BLOCKWISE = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                  "weight_block_size": [128, 128]}

# LongRoPE's per-frequency factors for a shape: the cost of a step does not depend on their
# values, so these are not the checkpoint's (its short factors are all 1; its long ones rise
# from 1 to about 48 across the frequencies, as these do).
def _long_rope(frequencies: int, threshold: int) -> dict[str, Any]:
    return {"type": "longrope", "short_factor": [1.0] * frequencies,
            "long_factor": [round(48.0 ** (i / (frequencies - 1)), 4)
                            for i in range(frequencies)],
            "original_max_position_embeddings": threshold}


# The published configs' shape fields (meta-llama/Llama-3.2-1B, Llama-3.1-8B, Qwen2.5-7B,
# Qwen/Qwen3-30B-A3B, mistralai/Mixtral-8x7B-v0.1, google/gemma-3-12b-it's text_config,
# microsoft/Phi-4-mini-instruct, openai/gpt-oss-20b).
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": _LLAMA3_ROPE, "tie_word_embeddings": True, "hidden_act": "silu",
        "torch_dtype": "bfloat16"},
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0}, "tie_word_embeddings": False,
        "hidden_act": "silu", "torch_dtype": "bfloat16"},
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "hidden_act": "silu", "torch_dtype": "bfloat16"},
    # 128 experts, 8 per token, in every layer (decoder_sparse_step 1, no mlp_only_layers): 30.5B
    # parameters, 3.3B of them active per token.
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
        "torch_dtype": "bfloat16"},
    # 8 experts, 2 per token: 46.7B parameters (93 GB in bf16: more than an H100's 80 GB), 12.9B
    # of them active per token.
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 8,
        "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16"},
    # The text model of google/gemma-3-12b-it (its text_config): 48 layers, five sliding over
    # 1024 tokens (local rotary base 10k) per global one (base 1M, scaled linearly by 8).
    "gemma-3-12b": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
        "query_pre_attn_scalar": 256, "vocab_size": 262208, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6, "sliding_window": 1024, "sliding_window_pattern": 6,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16"},
    # microsoft/Phi-4-mini-instruct: 32 layers, 24 query heads over 8 KV heads of 128 dims, of
    # which the first 96 rotate (partial_rotary_factor 0.75: 48 frequencies), LongRoPE past
    # 4096 tokens, a 200k vocabulary tied to the LM head. Its sliding_window (262144) is past
    # its context: every layer attends fully.
    "phi-4-mini": {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072,
        "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 24,
        "num_key_value_heads": 8, "vocab_size": 200064, "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": _long_rope(48, 4096),
        "sliding_window": 262144, "tie_word_embeddings": True, "hidden_act": "silu",
        "attention_bias": False, "torch_dtype": "bfloat16"},
    # openai/gpt-oss-20b: 24 layers alternating sliding (128 tokens) and full attention, 64 query
    # heads over 8 KV heads of 64 dims with a sink each, 32 experts of 2880, 4 per token, YaRN
    # rotary. The release stores its experts in MXFP4, which the engine dequantizes at load:
    # the shape's weights are bf16 from the start (about 42 GB).
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
        "num_experts_per_tok": 4, "vocab_size": 201088, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "sliding_window": 128, "attention_bias": True,
        "swiglu_limit": 7.0, "rope_theta": 150000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16"},
}
# The 8B as its block-wise FP8 checkpoints ship: a dummy load draws FP8 weights where the
# engine reads this quantization_config (workers/quantization). The other way to FP8 is
# `--quantization fp8` on the bf16 llama-3.1-8b shape (weights quantized as they load).
SHAPES["llama-3.1-8b-fp8"] = {**SHAPES["llama-3.1-8b"], "quantization_config": _FP8_BLOCKWISE}

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


def write_shape(name: str, folder: str | Path, tokenizer_from: str | Path,
                **overrides: Any) -> Path:
    """``folder`` with ``name``'s config.json (``overrides`` replace fields, e.g. fewer layers)
    and the tokenizer files of ``tokenizer_from`` (its ids must fit the shape's vocabulary)."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {**SHAPES[name], **overrides}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    copied = [f for f in _TOKENIZER_FILES if (Path(tokenizer_from) / f).exists()]
    if not copied:
        raise FileNotFoundError(f"no tokenizer files in {tokenizer_from}")
    for file in copied:
        shutil.copy(Path(tokenizer_from) / file, folder / file)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(folder)))
    if vocab > config["vocab_size"]:
        raise ValueError(f"the tokenizer of {tokenizer_from} has {vocab} tokens, more than "
                         f"{name}'s vocabulary of {config['vocab_size']}")
    if vocab < config["vocab_size"]:
        cover_vocabulary(folder, config["vocab_size"])
    return folder


# Fillers are letters and digits: every byte-level and metaspace BPE decodes them as themselves.
_FILLER_ALPHABET = string.ascii_letters + string.digits


def cover_vocabulary(folder: Path, vocab_size: int) -> None:
    """Fill the BPE vocabulary of ``folder``'s tokenizer.json up to ``vocab_size`` ids.

    Dummy weights sample ids from the model's whole vocabulary (128256 for Llama 3), and an id
    the tokenizer lacks decodes to nothing: with a smaller tokenizer (the default model's 49152,
    the small one's 400) a client would wait for visible text that almost never comes, and
    every TTFT timed to the first visible output would be missing (the first H100 run's
    bursts were). Each added id is a short string of letters and digits, never produced by
    encoding (no merge makes it), so prompts tokenize as before and every sampled id shows.
    """
    path = folder / "tokenizer.json"
    if not path.exists():
        raise ValueError(f"{folder} has no tokenizer.json: the vocabulary of a slow tokenizer "
                         f"cannot be filled up to {vocab_size} ids")
    data = json.loads(path.read_text())
    model = data["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"{folder}'s tokenizer is {model.get('type')}, not BPE: its vocabulary "
                         f"cannot be filled up to {vocab_size} ids")
    vocab: dict[str, int] = model["vocab"]
    added = data.get("added_tokens", [])
    taken = set(vocab) | {token["content"] for token in added}
    next_id = max([*vocab.values(), *(token["id"] for token in added)]) + 1
    fillers = ("".join(chars) for length in itertools.count(3)
               for chars in itertools.product(_FILLER_ALPHABET, repeat=length))
    for filler in fillers:
        if next_id >= vocab_size:
            break
        if filler not in taken:
            vocab[filler] = next_id
            next_id += 1
    path.write_text(json.dumps(data, ensure_ascii=False))
    # The slow tokenizer's files would disagree with tokenizer.json now; the fast one is used.
    for stale in ("vocab.json", "merges.txt"):
        (folder / stale).unlink(missing_ok=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("folder")
    parser.add_argument("--tokenizer-from", default=None,
                        help="a folder with tokenizer files (default: the default model's)")
    parser.add_argument("--small-tokenizer", action="store_true",
                        help="a small BPE tokenizer trained here instead (no default model, so "
                             "no download: for a machine without network access)")
    parser.add_argument("--num-hidden-layers", type=int, default=None,
                        help="fewer layers than the shape has (quicker runs)")


def run(args: argparse.Namespace) -> int:
    """`sloserve bench shape`: write the folder and print its path."""
    source = args.tokenizer_from
    if args.small_tokenizer:
        import tempfile

        from engine.benchmarks.inputs.random_checkpoints import save_small_tokenizer

        source = save_small_tokenizer(tempfile.mkdtemp(prefix="sloserve-tokenizer-"))
    elif source is None:
        from engine.entrypoints.default_model import model_path_or_default

        source = model_path_or_default(None)
    overrides = ({} if args.num_hidden_layers is None
                 else {"num_hidden_layers": args.num_hidden_layers})
    folder = write_shape(args.shape, args.folder, source, **overrides)
    print(folder)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
