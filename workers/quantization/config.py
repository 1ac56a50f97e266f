"""Reading a checkpoint's ``quantization_config`` (or ``--quantization fp8``) into an
``Fp8Config``, and refusing by name everything else.

Understood:

- ``"quant_method": "fp8"`` with ``"weight_block_size": [128, 128]``: float8_e4m3fn weights with
  a float32 ``weight_scale_inv`` per 128x128 block (Qwen3-FP8, DeepSeek-V3; transformers'
  ``FineGrainedFP8Config``). Activations are quantized per token and 128-column group on a GPU.
- ``"quant_method": "fp8"`` without blocks: one ``weight_scale`` per tensor, and an
  ``input_scale`` per tensor where ``activation_scheme`` is static (vLLM's and AutoFP8's
  serialized FP8 checkpoints).
- ``"quant_method": "compressed-tensors"`` (``workers.quantization.compressed_tensors``).
- ``"quant_method": "mxfp4"``: gpt-oss's experts, dequantized at load
  (``workers.quantization.mxfp4``).
- ``--quantization fp8`` on a full-precision checkpoint: each linear weight quantized at load,
  one scale per output channel, activations quantized per token on a GPU (vLLM's scheme).

The LM head, the embeddings and the MoE routers never reach here: the model files ask only for
their attention and MLP projections.
"""

from __future__ import annotations

from typing import Any

from workers.quantization.compressed_tensors import parse_compressed_tensors
from workers.quantization.fp8_config import Fp8Config, SchemeGroup
from workers.quantization.fp8_numerics import BLOCK
from workers.quantization.fp8_scheme import Fp8Scheme
from workers.quantization.mxfp4 import Mxfp4Config, parse_mxfp4

# --quantization's values (vLLM's flag; None: the checkpoint decides).
QUANTIZATION_CHOICES = ("fp8",)
# Checkpoint quant_methods known to exist but not served here, for a precise refusal.
_KNOWN_UNSUPPORTED = ("awq", "gptq", "bitsandbytes", "gguf", "marlin", "exl2", "hqq", "aqlm",
                      "eetq", "fbgemm_fp8", "modelopt", "quark", "torchao", "bitnet",
                      "higgs", "vptq", "spqr", "auto-round", "fp_quant", "w8a8_int8")


def raw_quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config`` as a dict (transformers may hold an object)."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    if hasattr(raw, "to_dict"):
        raw = raw.to_dict()
    if not isinstance(raw, dict):
        raise ValueError(f"quantization_config must be a JSON object, got {type(raw).__name__}")
    return raw


def parse_quant_config(raw: dict[str, Any] | None,
                       quantization: str | None) -> Fp8Config | Mxfp4Config | None:
    """The ``Fp8Config`` of a checkpoint's ``quantization_config`` and the ``--quantization``
    asked for; None for plain weights. A ValueError names what is not understood."""
    if quantization is not None and quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization {quantization!r} is not supported; choose one of "
                         f"{', '.join(QUANTIZATION_CHOICES)} (or none)")
    if raw is None:
        return None if quantization is None else online_fp8_config()
    method = str(raw.get("quant_method", "")).lower()
    if quantization is not None and method.replace("_", "-") != quantization:
        # vLLM refuses the same mismatch: the flag cannot re-quantize quantized weights.
        raise ValueError(f"quantization {quantization!r} asked for, but the checkpoint's "
                         f"quantization_config says quant_method {method!r}: leave "
                         f"--quantization unset to serve the checkpoint as it is")
    if method == "fp8":
        return parse_fp8(raw)
    if method in ("compressed-tensors", "compressed_tensors"):
        return parse_compressed_tensors(raw)
    if method == "mxfp4":
        return parse_mxfp4(raw)
    known = " (a method this engine does not implement)" if method in _KNOWN_UNSUPPORTED else ""
    raise ValueError(f"unsupported quantization_config quant_method {method or '(none)'!r}"
                     f"{known}; supported: 'fp8' (block-wise or per-tensor float8_e4m3fn), "
                     f"'compressed-tensors' FP8 (float-quantized) and 'mxfp4' (gpt-oss's "
                     f"experts)")


def online_fp8_config() -> Fp8Config:
    """``--quantization fp8`` on a full-precision checkpoint."""
    scheme = Fp8Scheme(weight_strategy="channel", activations="dynamic", online=True)
    return Fp8Config(name="fp8", groups=(SchemeGroup(scheme),), source={"quantization": "fp8"})


def parse_fp8(raw: dict[str, Any]) -> Fp8Config:
    """The ``"quant_method": "fp8"`` layouts: 128x128 blocks, or per-tensor scales."""
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quant_method 'fp8' with fmt {fmt!r} is not supported (only e4m3: "
                         f"float8_e4m3fn weights)")
    activation = raw.get("activation_scheme", "dynamic")
    if activation not in ("dynamic", "static"):
        raise ValueError(f"quant_method 'fp8': unknown activation_scheme {activation!r} "
                         f"(dynamic or static)")
    block = raw.get("weight_block_size")
    if block is not None:
        if list(block) != [BLOCK, BLOCK]:
            raise ValueError(f"quant_method 'fp8' with weight_block_size {list(block)} is not "
                             f"supported (only [{BLOCK}, {BLOCK}])")
        if activation != "dynamic":
            raise ValueError("quant_method 'fp8' with weight_block_size needs activation_scheme "
                             "'dynamic' (block-scaled activations are computed per step)")
        scheme = Fp8Scheme(weight_strategy="block", activations="dynamic",
                           scale_name="weight_scale_inv")
    else:
        scheme = Fp8Scheme(weight_strategy="tensor", activations=activation)
    # transformers writes modules_to_not_convert; vLLM's own checkpoints ignored_layers.
    ignore = [*(raw.get("ignored_layers") or []), *(raw.get("modules_to_not_convert") or [])]
    return Fp8Config(name="fp8", groups=(SchemeGroup(scheme),), ignore=tuple(map(str, ignore)),
                     source=raw)
