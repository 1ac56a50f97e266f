"""HF transformers' greedy `generate`, the reference every engine output is compared with."""

from __future__ import annotations

import torch


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int,
              dtype: torch.dtype = torch.float32) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=None,
                                 pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs
