"""HF transformers' greedy `generate`: the reference every engine output is compared with."""

from __future__ import annotations

from typing import Any

import torch


def fastest_attention(config: Any) -> str:
    """The attention implementation a benchmark gives HF transformers: SDPA, its fastest on a
    CPU, where the family supports it; eager where it does not (Gemma 2: SDPA has no
    soft-cap)."""
    from transformers import AutoModelForCausalLM

    try:
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return "sdpa"
    return "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"


def load_hf_model(model_dir: str, dtype: torch.dtype = torch.float32,
                  device: str = "cpu") -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    model.eval()
    return model


def hf_greedy(model_dir: str | Any, prompts: list[list[int]], max_new_tokens: int,
              dtype: torch.dtype = torch.float32, device: str = "cpu") -> list[list[int]]:
    """Each prompt alone (no padding), greedy, no EOS stop. ``model_dir``: a folder, or a model
    `load_hf_model` returned (to load it once for several calls)."""
    model = load_hf_model(model_dir, dtype, device) if isinstance(model_dir, str) else model_dir
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=model.device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=None,
                                 pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def top2_margin(model: Any, tokens: list[int]) -> float:
    """The reference's lead of its top-1 next-token logit over the runner-up after ``tokens``:
    where an output first diverges, a margin near float32 noise says the two argmaxes sat on a
    near-tie, a clear margin says the engine computed something else."""
    with torch.inference_mode():
        logits = model(torch.tensor([tokens], device=model.device)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])
