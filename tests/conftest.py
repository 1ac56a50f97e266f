import os

# Tests never touch a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every engine times its steps before serving (engine/runtime/startup_calibration.py); the
# suite starts hundreds, and a tiny model's sizes need far less than the 5 s a real one gets.
os.environ.setdefault("SLOSERVE_STARTUP_CALIBRATION_S", "0.3")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Factory: tiny_model(arch, **overrides) -> folder with seeded random weights and a tokenizer."""
    from tests.tiny_models import make_tiny_model
    from tests.tiny_tokenizer import save_tiny_tokenizer

    made: dict[tuple, str] = {}

    def make(arch: str = "llama", **overrides) -> str:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in made:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            save_tiny_tokenizer(path)
            from transformers import AutoTokenizer

            vocab = len(AutoTokenizer.from_pretrained(str(path)))
            make_tiny_model(path, arch=arch, seed=0, vocab_size=vocab, **overrides)
            made[key] = str(path)
        return made[key]

    return make
