import json
import os

# Tests never touch a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every engine times its steps before serving (engine/runtime/startup_calibration.py); the
# suite starts hundreds, and a tiny model's sizes need far less than the 5 s a real one gets.
os.environ.setdefault("SLOSERVE_STARTUP_CALIBRATION_S", "0.3")
# Side by side under pytest-xdist (the README's test command), each worker and the servers it
# starts take one torch thread: a worker's OpenMP threads spinning on the other's cores cost
# the run about a minute of CPU on two cores. Read by torch at import, so set before it.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402

# No per-example deadline: a property test checks what is computed, not how fast, and on a
# shared two-core machine an example of a few ms can take hundreds (a timing assertion in all
# but name). Speed is measured by the benchmarks.
hypothesis_settings.register_profile("sloserve", deadline=None)
hypothesis_settings.load_profile("sloserve")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Factory: tiny_model(arch, **overrides) -> folder with seeded random weights and a tokenizer."""
    from tests.utils.tiny_models import make_tiny_model
    from tests.utils.tiny_tokenizer import save_tiny_tokenizer

    made: dict[tuple, str] = {}

    def make(arch: str = "llama", **overrides) -> str:
        # Overrides may hold dicts and lists (rope_scaling): keyed by their JSON.
        key = (arch, json.dumps(overrides, sort_keys=True))
        if key not in made:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            save_tiny_tokenizer(path)
            from transformers import AutoTokenizer

            vocab = len(AutoTokenizer.from_pretrained(str(path)))
            make_tiny_model(path, arch=arch, seed=0, vocab_size=vocab, **overrides)
            made[key] = str(path)
        return made[key]

    return make


@pytest.fixture
def triton_device():
    """The device the Triton kernel tests run on (tests/utils/triton_device.py): the CPU in Triton's
    interpreter, or a GPU with compiled kernels under TRITON_INTERPRET=0."""
    from tests.utils.triton_device import triton_device as device

    return device()


@pytest.fixture(scope="session")
def sim_model(tmp_path_factory) -> str:
    """A folder of the Llama-3.1-8B shape (config.json and a tiny tokenizer, no weights): what a
    simulated engine (`--simulate h100-llama-3.1-8b`) reads of a model."""
    from engine.benchmarks.inputs.model_shapes import write_shape
    from tests.utils.tiny_tokenizer import save_tiny_tokenizer

    tokenizer = save_tiny_tokenizer(tmp_path_factory.mktemp("sim-tokenizer"))
    return str(write_shape("llama-3.1-8b", tmp_path_factory.mktemp("sim-llama-8b"), tokenizer))
