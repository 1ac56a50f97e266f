"""Fixtures of the quantization tests: tiny float32 models shaped so that every weight splits
into whole 128x128 FP8 blocks (at TP=1 and TP=2), and FP8 checkpoints written from them
(tests/utils/fp8_checkpoints.py)."""

from __future__ import annotations

import pytest

# hidden 256 and head_dim 128: q, k, v, o and the MLP's 512 columns are whole blocks, also
# split over two ranks (each rank's q, k and v are one head of 128 rows).
FP8_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=128, num_hidden_layers=2)


@pytest.fixture(scope="session")
def fp8_source(tiny_model):
    """Factory: fp8_source(arch) -> a tiny float32 model folder of FP8_SHAPE."""
    return lambda arch="llama": tiny_model(arch, **FP8_SHAPE)


@pytest.fixture(scope="session")
def fp8_checkpoint(fp8_source, tmp_path_factory):
    """Factory: fp8_checkpoint(arch, layout) -> (FP8 checkpoint folder, its float32
    dequantization) for layout "block", "channel" or "tensor"."""
    from tests.utils.fp8_checkpoints import write_fp8_checkpoint

    made: dict[tuple[str, str], tuple[str, str]] = {}

    def make(arch: str = "llama", layout: str = "block") -> tuple[str, str]:
        if (arch, layout) not in made:
            root = tmp_path_factory.mktemp(f"fp8-{arch}-{layout}")
            made[arch, layout] = write_fp8_checkpoint(fp8_source(arch), root / "fp8",
                                                      root / "reference", layout)
        return made[arch, layout]

    return make
