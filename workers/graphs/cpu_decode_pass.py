"""The CPU's counterpart of a decode CUDA graph: a decode-only step through every layer in one
compiled call (``kernels.cpu_decode_pass``), where the layered path makes ~10 Python calls a
layer.

``plan_decode_pass(model)`` reads the model once, after its weights are loaded and given their
bfloat16 copies, into a table of addresses (one row per layer); the model runner asks the plan to
run each decode-only step it may serve (``CpuDecodePass.run``) and runs the layered forward
otherwise. The plan serves a model the layered path runs on the CPU's loops in every layer:

- float32 on the CPU, one tensor-parallel rank (the layered path all-reduces inside the layer),
  the fused loops serving it (``kernels.cpu_fused.serves``);
- the shared decoder's layer, RMSNorm and SwiGLU MLP (``workers.models.decoder``: Llama, Qwen2,
  Qwen3 with its q/k norms, Mistral and the other dense families; not Gemma's norms, not
  mixtures of experts), whole-head rotary from one table, no embedding scale;
- every projection holding a bfloat16 copy (``workers.layers.cpu_bf16_weights``): the plan
  serves steps of up to the fewest rows any copy serves, so that every product is the one the
  layered path computes. A model whose weights are not bfloat16 values gets no plan.

Its hidden states are bit for bit the layered path's (the same loops in the same order).
``SLOSERVE_CPU_DECODE_PASS=0`` (and ``--enforce-eager``) keep every step on the layered path.

The plan keeps every tensor its table addresses (weights, copies, the KV caches it was bound to),
so that no address outlives its memory; a KV pool replaced by a resize is bound again on the
next step.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from kernels import cpu_decode_pass, cpu_fused
from kernels.cpu_decode_pass import FIELD, FIELDS, address
from kernels.metadata import AttentionMetadata
from workers.layers.norm import RMSNorm
from workers.models.decoder import DecoderAttention, DecoderLayer, DecoderMLP

logger = logging.getLogger(__name__)

DECODE_PASS_ENV = "SLOSERVE_CPU_DECODE_PASS"
KVCache = tuple[torch.Tensor, torch.Tensor]


class CpuDecodePass:
    """A model's layer table and what the compiled pass needs besides each step's inputs."""

    def __init__(self, model: nn.Module, table: torch.Tensor, keep: list[Any],
                 max_rows: int) -> None:
        attention: DecoderAttention = model.model.layers[0].self_attn
        self.table = table
        self._keep = keep  # owns every address in the table but the KV caches'
        self.max_rows = max_rows
        self.num_layers = model.num_layers
        self.hidden = model.config.hidden_size
        self.heads, self.kv_heads = attention.num_heads, attention.num_kv_heads
        self.head_dim = attention.head_dim
        self.intermediate = model.model.layers[0].mlp.down_proj.input_size_per_partition
        self.eps = float(model.model.norm.eps)
        self.scale = float(model.scale)
        self.softcap = float(model.attn_softcap or 0.0)
        self.embedding = model.model.embed_tokens.weight.detach()
        self.cos_sin = model.model.rotary_emb.cos_sin
        self.final_norm = model.model.norm.weight.detach()
        self._bound: list[KVCache] | None = None
        self.block_size = 0  # the bound KV caches' (_bind)
        self._scratch: dict[int, torch.Tensor] = {}
        # Steps this plan ran (a probe for tests and diagnostics).
        self.steps_run = 0

    def serves(self, num_tokens: int, attn_meta: AttentionMetadata) -> bool:
        """Whether a step of ``num_tokens`` tokens with this metadata is a decode-only step the
        plan runs: one token a decode, at most ``max_rows`` of them."""
        return 0 < num_tokens <= self.max_rows and attn_meta.num_decodes == num_tokens

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            attn_meta: AttentionMetadata, kv_caches: list[KVCache]) -> torch.Tensor:
        """The final-normed hidden states [rows, hidden] of a decode-only step (``serves``),
        as ``DecoderForCausalLM.forward`` returns them, its K/V written to the caches."""
        rows = input_ids.shape[0]
        if kv_caches is not self._bound:
            self._bind(kv_caches)
        scratch = self._scratch.get(rows)
        if scratch is None:
            scratch = self._scratch[rows] = torch.empty(cpu_decode_pass.scratch_floats(
                rows, self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate))
        out = torch.empty(rows, self.hidden)
        tables = _int64(attn_meta.decode_block_tables)
        cpu_decode_pass.run(
            self.table, self.embedding, self.cos_sin, self.final_norm, _int64(input_ids),
            _int64(positions), _int64(attn_meta.slot_mapping), tables,
            _int64(attn_meta.decode_context_lens),
            scratch, out, rows, self.num_layers, self.hidden, self.heads, self.kv_heads,
            self.head_dim, self.intermediate, self.block_size, tables.stride(0),
            cpu_fused.PARALLEL_SLOTS, self.eps, self.scale, self.softcap)
        self.steps_run += 1
        return out

    def _bind(self, kv_caches: list[KVCache]) -> None:
        """Point each layer's row at its KV caches (contiguous float32, as the pool makes them)."""
        for layer, (key_cache, value_cache) in enumerate(kv_caches):
            if not (key_cache.is_contiguous() and value_cache.is_contiguous()
                    and key_cache.dtype == value_cache.dtype == torch.float32):
                raise ValueError("the CPU decode pass needs contiguous float32 KV caches")
            self.table[layer, FIELD["key_cache"]] = key_cache.data_ptr()
            self.table[layer, FIELD["value_cache"]] = value_cache.data_ptr()
        self._bound = kv_caches
        self.block_size = kv_caches[0][0].shape[1]


def _int64(tensor: torch.Tensor) -> torch.Tensor:
    """A step input as the pass reads it: int64 with a dense last dimension (the runner's
    buffers already are; block table rows may be a slice of a wider buffer, read by stride)."""
    if tensor.dtype != torch.int64 or tensor.stride(-1) != 1:
        tensor = tensor.to(torch.int64).contiguous()
    return tensor


def decode_pass_setting() -> bool:
    """``SLOSERVE_CPU_DECODE_PASS``: on unless "0"."""
    return os.environ.get(DECODE_PASS_ENV, "1") != "0"


def plan_decode_pass(model: nn.Module) -> CpuDecodePass | None:
    """The decode pass of ``model`` (module docstring), or None, with the reason logged, where
    the pass does not serve it. Compiles the pass the first time one is planned (~2 s)."""
    reason = _unserved_reason(model)
    if reason is None and not cpu_decode_pass.warm_up():
        reason = "the pass does not compile here"
    if reason is not None:
        logger.info("CPU decode pass: off (%s); decode steps run layer by layer", reason)
        return None
    keep: list[Any] = []
    table = torch.zeros(model.num_layers, len(FIELDS), dtype=torch.int64)
    for i, layer in enumerate(model.model.layers):
        attention, mlp = layer.self_attn, layer.mlp
        row = {
            "input_norm": layer.input_layernorm.weight, "post_norm":
            layer.post_attention_layernorm.weight,
            "q_norm": attention.q_norm.weight if attention.q_norm is not None else None,
            "k_norm": attention.k_norm.weight if attention.k_norm is not None else None,
            "qkv_bias": attention.qkv_proj.bias, "o_bias": attention.o_proj.bias,
            "gate_up_bias": mlp.gate_up_proj.bias, "down_bias": mlp.down_proj.bias,
            "qkv_weight": attention.qkv_proj.bf16_weight.packed,
            "o_weight": attention.o_proj.bf16_weight.packed,
            "gate_up_weight": mlp.gate_up_proj.bf16_weight.packed,
            "down_weight": mlp.down_proj.bf16_weight.packed,
        }
        for name, tensor in row.items():
            tensor = None if tensor is None else tensor.detach()
            keep.append(tensor)
            table[i, FIELD[name]] = address(tensor)
        table[i, FIELD["window"]] = model.layer_windows[i] or 0
    linears = [m for layer in model.model.layers for m in _linears(layer)]
    max_rows = min(m.bf16_max_rows for m in linears)
    logger.info("CPU decode pass: decode steps of up to %d rows run every layer in one compiled "
                "call", max_rows)
    return CpuDecodePass(model, table, keep, max_rows)


def _linears(layer: DecoderLayer) -> list[nn.Module]:
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj]


def _unserved_reason(model: nn.Module) -> str | None:
    """Why the pass does not serve ``model`` (None: it does)."""
    if not decode_pass_setting():
        return f"{DECODE_PASS_ENV}=0"
    if getattr(model, "device", None) is None or model.device.type != "cpu":
        return "not on the CPU"
    if model.dtype != torch.float32:
        return f"{model.dtype} weights, float32 only"
    if not cpu_fused.serves(model.dtype, model.config.hidden_size):
        return "the fused CPU loops do not serve this model"
    decoder = model.model
    if len(model.kv_cache_groups) > 1:
        return "layers in several KV cache groups (a block table each)"
    if decoder.embed_tokens.tp_size != 1:
        return "tensor parallel"
    if decoder.embed_scale is not None or len(decoder.rotary_embs) != 1:
        return "scaled embeddings or more than one rotary table"
    for name, table in (("embedding", decoder.embed_tokens.weight),
                        ("rotary table", decoder.rotary_emb.cos_sin)):
        if table.is_mkldnn or table.dtype != torch.float32 or not table.is_contiguous():
            return f"the {name} is not a contiguous float32 tensor"
    if type(decoder.norm) is not RMSNorm:
        return f"{type(decoder.norm).__name__} norms"
    attention0 = decoder.layers[0].self_attn
    if decoder.rotary_emb.rotary_dim != attention0.head_dim or attention0.head_dim % 2:
        return "partial rotary"
    if attention0.head_dim > cpu_fused.MAX_HEAD_DIM:
        return f"head_dim {attention0.head_dim} > {cpu_fused.MAX_HEAD_DIM}"
    for layer in decoder.layers:
        if type(layer) is not DecoderLayer or type(layer.mlp) is not DecoderMLP:
            return f"{type(layer).__name__} / {type(layer.mlp).__name__} layers"
        if layer.mlp.activation != "silu":
            return f"the {layer.mlp.activation} activation"
        attention = layer.self_attn
        norms = [layer.input_layernorm, layer.post_attention_layernorm, attention.q_norm,
                 attention.k_norm]
        if (attention.q_norm is None) != (attention.k_norm is None):
            return "a q norm without a k norm"
        for norm in (n for n in norms if n is not None):
            if type(norm) is not RMSNorm or norm.eps != decoder.norm.eps:
                return "norms of another kind or epsilon"
        for linear in _linears(layer):
            if getattr(linear, "bf16_weight", None) is None or not linear.bf16_max_rows:
                return "a projection without a bfloat16 weight copy"
    return None
