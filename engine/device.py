"""`--device auto` (the default): the GPU when torch sees one, else the CPU, as vLLM and SGLang
choose.

Resolved once, in the process that builds the configuration (ModelConfig does it on
construction), so every process started afterwards (EngineCore, TP workers) is handed a
concrete 'cpu' or 'cuda' and never decides for itself. Under torchrun every rank builds its own
configuration from the same arguments, as it does for everything else.

`torch.cuda.is_available()` initialises the CUDA driver in this process (cuInit; no context,
no GPU memory), which would break a *forked* child's CUDA. The engine never forks: EngineCore
and the TP workers are started with multiprocessing's spawn context, and torchrun starts fresh
interpreters, so nothing inherits this state. (A program of one's own that forks after building
an LLM can set PYTORCH_NVML_BASED_CUDA_CHECK=1, which makes the check ask NVML instead.)
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")


def auto_device() -> tuple[str, str]:
    """('cuda' or 'cpu', why), for the log."""
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        # Distinct names only: eight H100s read as one name.
        names = ", ".join(dict.fromkeys(torch.cuda.get_device_name(i) for i in range(count)))
        return "cuda", f"{count} GPU{'' if count == 1 else 's'} visible ({names})"
    if torch.version.cuda is None:
        return "cpu", f"torch {torch.__version__} has no CUDA"
    return "cpu", (f"no GPU visible (torch {torch.__version__} is built for CUDA "
                   f"{torch.version.cuda}, and torch.cuda.is_available() is False)")


def resolve_device(name: str, *, simulate: bool = False) -> str:
    """'cpu' or 'cuda' for a device argument; 'auto' is decided here and logged with why.
    ``simulate``: a --simulate engine runs no model, so auto means the CPU."""
    if name not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(map(repr, DEVICES))}, got {name!r}")
    if name != "auto":
        return name
    if simulate:
        device, why = "cpu", "--simulate runs no model"
    else:
        device, why = auto_device()
    logger.info("device auto -> %s: %s", device, why)
    return device
