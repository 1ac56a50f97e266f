"""sloserve engine: requests, KV cache, scheduler, EngineCore and the offline LLM API."""

from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it lazily so light users (IPC, CLI help) stay fast.
    if name == "LLM":
        from engine.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
