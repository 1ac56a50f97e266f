"""Our models of every family, dense and mixtures of experts, over a paged KV cache against HF
transformers' forward (float32)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from tests.utils.paged_helpers import KVCaches, PagedSequence, make_kv_caches, paged_step  # noqa: E402
from tests.utils.tiny_models import make_tiny_config, make_tiny_model  # noqa: E402
from workers.kv_cache import allocate_kv_caches, kv_cache_bytes_per_block  # noqa: E402
from workers.layers import rope_parameters  # noqa: E402
from workers.models import build_model, get_model_class  # noqa: E402
from workers.models.llama import LlamaForCausalLM  # noqa: E402
from workers.startup.weight_loader import load_weights  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 32
ATOL = 2e-4  # logits are O(1-10); float32 summation-order noise is ~1e-5

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 256}
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-yarn-rope": ("llama", {"rope_parameters": YARN_ROPE}),
    "llama-untied-biases": ("llama", {"tie_word_embeddings": False, "attention_bias": True,
                                      "mlp_bias": True}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    # Mixtures of experts: 8 experts, 2 per token.
    "qwen3-moe": ("qwen3_moe", {}),
    "qwen3-moe-unnormalized-dense-layer": ("qwen3_moe", {"norm_topk_prob": False,
                                                         "mlp_only_layers": [1]}),
    "qwen2-moe-shared-expert": ("qwen2_moe", {}),
    "mixtral": ("mixtral", {}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    arch, overrides = VARIANTS[request.param]
    return make_tiny_model(tmp_path_factory.mktemp(request.param), arch, seed=0, **overrides)


def _hf_logits(model_dir: str, sequences: list[list[int]]) -> list[torch.Tensor]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [hf(torch.tensor([seq])).logits[0] for seq in sequences]


def _our_model(model_dir: str) -> LlamaForCausalLM:
    model = build_model(AutoConfig.from_pretrained(model_dir), torch.float32, torch.device("cpu"))
    load_weights(model, model_dir)
    return model


def _caches(model: LlamaForCausalLM) -> KVCaches:
    return make_kv_caches(model, NUM_BLOCKS, BLOCK_SIZE)


def _random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_chunked_prefill_and_decode_match_hf(model_dir: str) -> None:
    """A 100-token prompt in three chunks of different sizes, then two decode steps, on
    non-contiguous blocks; every position's logits equal HF's full-sequence forward."""
    model = _our_model(model_dir)
    seq = PagedSequence(_random_tokens(102, seed=1), blocks=[9, 3, 17, 0, 25, 6, 30])
    (ref,) = _hf_logits(model_dir, [seq.tokens])
    kv_caches = _caches(model)
    for n in (37, 21, 42):
        paged_step(model, kv_caches, [(seq, n)], num_decodes=0)
    for _ in range(2):
        paged_step(model, kv_caches, [(seq, 1)], num_decodes=1)
    torch.testing.assert_close(torch.stack(seq.logits), ref, atol=ATOL, rtol=0)


def test_mixed_decode_and_prefill_batch_matches_hf(model_dir: str) -> None:
    model = _our_model(model_dir)
    a = PagedSequence(_random_tokens(41, seed=2), blocks=[5, 12, 1])
    b = PagedSequence(_random_tokens(60, seed=3), blocks=[20, 2, 14, 8])
    ref_a, ref_b = _hf_logits(model_dir, [a.tokens, b.tokens])
    kv_caches = _caches(model)
    paged_step(model, kv_caches, [(a, 40), (b, 25)], num_decodes=0)  # two prefills in one batch
    paged_step(model, kv_caches, [(a, 1), (b, 35)], num_decodes=1)  # decode + chunk with a prefix
    torch.testing.assert_close(torch.stack(a.logits), ref_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.stack(b.logits), ref_b, atol=ATOL, rtol=0)


def test_model_attributes_and_tied_head(model_dir: str) -> None:
    config = AutoConfig.from_pretrained(model_dir)
    model = _our_model(model_dir)
    assert model.num_layers == config.num_hidden_layers
    assert model.num_kv_heads == config.num_key_value_heads
    assert model.head_dim == (getattr(config, "head_dim", None)
                              or config.hidden_size // config.num_attention_heads)
    assert model.vocab_size == config.vocab_size
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == bool(config.tie_word_embeddings)


def test_before_attention_hook_sees_every_layer_in_order(tmp_path: Path) -> None:
    model = _our_model(make_tiny_model(tmp_path, "llama"))
    seen: list[int] = []
    model.before_attention = seen.append
    paged_step(model, _caches(model), [(PagedSequence(_random_tokens(5, seed=4), blocks=[3]), 5)], 0)
    assert seen == list(range(model.num_layers))

    def stop_at_layer_2(layer_idx: int) -> None:
        if layer_idx == 2:
            raise RuntimeError("preempted")

    model.before_attention = stop_at_layer_2
    with pytest.raises(RuntimeError, match="preempted"):
        paged_step(model, _caches(model), [(PagedSequence(_random_tokens(5, seed=4), blocks=[3]), 5)], 0)


def test_tiny_models_have_clear_top1_margins(model_dir: str) -> None:
    """Greedy tests need a top-1 that float32 noise (~1e-5 relative) cannot flip."""
    logits = torch.cat(_hf_logits(model_dir, [_random_tokens(256, seed=s) for s in (5, 6)]))
    top2 = logits.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]) / logits.std()
    assert margin.median() > 0.05
    assert margin.quantile(0.01) > 2e-4


def test_unsupported_architecture_is_named() -> None:
    config = make_tiny_config("llama")
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        get_model_class(config)
    assert "LlamaForCausalLM" in str(err.value)  # lists what is supported


@pytest.mark.parametrize("rope_type", ["dynamic"])
def test_unsupported_rope_type_is_named(rope_type: str) -> None:
    config = make_tiny_config("llama", architectures=["LlamaForCausalLM"])
    config.rope_parameters = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match=rope_type):
        build_model(config, torch.float32, torch.device("cpu"))


def test_legacy_rope_fields_are_read() -> None:
    class Legacy:  # a pre-5.x config: rope_theta plus rope_scaling spelled with "type"
        rope_theta = 5e5
        rope_scaling = {"type": "linear", "factor": 2.0}

    assert rope_parameters(Legacy()) == {"type": "linear", "factor": 2.0, "rope_theta": 5e5,
                                         "rope_type": "linear"}

    class Plain:
        rope_theta = 1e6

    assert rope_parameters(Plain()) == {"rope_theta": 1e6, "rope_type": "default"}


def test_missing_and_unexpected_weights_are_reported(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "qwen2")
    path = tmp_path / "model.safetensors"
    weights = load_file(str(path))
    save_file({k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.weight"},
              str(path))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight.*k"):
        load_weights(build_model(AutoConfig.from_pretrained(model_dir), torch.float32, "cpu"),
                     model_dir)
    save_file({**weights, "model.layers.9.mlp.up_proj.weight": weights["model.norm.weight"].clone()},
              str(path))
    with pytest.raises(ValueError, match=r"model\.layers\.9\.mlp\.up_proj\.weight"):
        load_weights(build_model(AutoConfig.from_pretrained(model_dir), torch.float32, "cpu"),
                     model_dir)


def test_kv_cache_allocation_and_sizing() -> None:
    caches = allocate_kv_caches(3, 10, 16, 2, 8, torch.bfloat16, "cpu")
    assert len(caches) == 3
    for key_cache, value_cache in caches:
        assert key_cache.shape == value_cache.shape == (10, 16, 2, 8)
        assert key_cache.dtype == torch.bfloat16 and not key_cache.any()
        assert key_cache.data_ptr() != value_cache.data_ptr()
    per_block = kv_cache_bytes_per_block(3, 16, 2, 8, torch.bfloat16)
    assert per_block * 10 == sum(k.nbytes + v.nbytes for k, v in caches)
