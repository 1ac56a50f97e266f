"""The decoder every family shares: attention, the dense SwiGLU MLP, the layer, the model body
and the causal-LM wrapper with its one attention op (where a step can stop).

A family is a thin subclass of ``DecoderForCausalLM`` (``workers.models.llama`` for the dense
ones, ``workers.models.gemma`` for Gemma's, ``workers.models.qwen_moe`` and
``workers.models.mixtral`` for mixtures of experts): class switches for where biases sit,
whether q/k are normed, which layers slide (``sliding_windows``), the layer and norm classes,
the attention and embedding scales, and ``make_mlp`` for what follows attention in each layer. Module names mirror HF's (``model.layers.N.self_attn...``) except the
fused ``qkv_proj`` and ``gate_up_proj`` and the experts' stacked ``w13_weight``/``w2_weight``, so
the weight loader's mapping is a short table (``checkpoint_renames`` adds a family's own).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from engine.core.kv_groups import KVCacheGroup, kv_cache_groups, layer_groups
from kernels import AttentionMetadata, KernelBackend, select_backend
from workers.layers import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                            RMSNorm, RowParallelLinear, VocabParallelEmbedding, apply_rotary,
                            get_rotary_embedding, silu_and_mul)
from workers.layers.linear import weakly_bound
from workers.layers.activation import gelu_tanh_and_mul
from workers.layers.rotary import layer_rope_types
from workers.preemption.slo_preempt_vote import StepSLOPreempted
from workers.quantization import QuantizationConfig

KVCache = tuple[torch.Tensor, torch.Tensor]
# attention_op(layer_idx, q, k, v, attn_meta, kv_cache) -> attention output [T, Hq, D]
AttentionOp = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata,
                        KVCache], torch.Tensor]


class ParallelContext:
    """What every layer is built with: dtype, device, tensor-parallel placement, and the
    checkpoint's quantization (which linear layers hold quantized weights)."""

    def __init__(self, dtype: torch.dtype, device: torch.device, tp_rank: int, tp_size: int,
                 tp_group: dist.ProcessGroup | None,
                 quant_config: QuantizationConfig | None = None) -> None:
        self.dtype, self.device = dtype, device
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.quant_config = quant_config
        # The family's RMSNorm (Gemma's scales by 1 + weight).
        self.norm: type[RMSNorm] = RMSNorm

    def args(self, with_group: bool = False) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(dtype=self.dtype, device=self.device, tp_rank=self.tp_rank,
                                      tp_size=self.tp_size)
        if with_group:
            kwargs["tp_group"] = self.tp_group
        return kwargs

    def linear_args(self, prefix: str, with_group: bool = False) -> dict[str, Any]:
        """``args`` plus the quantization method of the linear layer named ``prefix``."""
        quant = self.quant_config.linear_method(prefix) if self.quant_config else None
        return {**self.args(with_group), "quant_method": quant}

    def experts_method(self, prefix: str) -> Any:
        return self.quant_config.experts_method(prefix) if self.quant_config else None


def head_dim_of(config: Any) -> int:
    # Qwen3 sets head_dim explicitly (it need not be hidden / heads); others may leave it None.
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    def __init__(self, config: Any, par: ParallelContext, prefix: str, *, qkv_bias: bool,
                 o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, num_heads,
                                          num_kv_heads, bias=qkv_bias,
                                          **par.linear_args(f"{prefix}.qkv_proj"))
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size,
                                        bias=o_bias,
                                        **par.linear_args(f"{prefix}.o_proj", with_group=True))
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm:
            self.q_norm = par.norm(self.head_dim, config.rms_norm_eps, dtype=par.dtype,
                                   device=par.device)
            self.k_norm = par.norm(self.head_dim, config.rms_norm_eps, dtype=par.dtype,
                                   device=par.device)
        # The backend's fused rotary kernel where it has one (DecoderForCausalLM.use_kernels).
        self.apply_rotary: Callable[..., torch.Tensor] = apply_rotary
        # gpt-oss's attention sinks: this rank's heads' logits (add_sinks); None: none.
        self.sinks: nn.Parameter | None = None
        self._tp_rank = par.tp_rank

    def add_sinks(self) -> None:
        """A learned logit per query head that counts in its softmax denominator and holds no
        value (gpt-oss), float32 as HF keeps it; each rank loads its own heads'."""
        device = self.qkv_proj.weight.device
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32,
                                              device=device), requires_grad=False)
        self.sinks.weight_loader = weakly_bound(self._load_sinks)  # type: ignore[attr-defined]

    def _load_sinks(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"unexpected shard_id {shard_id!r} for attention sinks")
        start = self._tp_rank * self.num_heads
        if loaded.dim() != 1 or loaded.shape[0] < start + self.num_heads:
            raise ValueError(f"attention sinks of shape {tuple(loaded.shape)}: expected one "
                             f"logit per query head")
        param.data.copy_(loaded[start:start + self.num_heads])

    def project_qkv(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] and k [T, Hkv, D] rotated, and v [T, Hkv, D]: the attention op's inputs."""
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        v = qkv[:, q_size + kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is None or self.k_norm is None:
            # q and k are adjacent in qkv, so one rotary pass covers both.
            qk = qkv[:, :q_size + kv_size].view(num_tokens, -1, self.head_dim)
            qk = self.apply_rotary(qk, cos, sin)
            return qk[:, :self.num_heads], qk[:, self.num_heads:], v
        q = qkv[:, :q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, q_size:q_size + kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        return (self.apply_rotary(self.q_norm(q), cos, sin),
                self.apply_rotary(self.k_norm(k), cos, sin), v)

    def project_out(self, attention_out: torch.Tensor) -> torch.Tensor:
        """The attention op's output [T, Hq, D] through o_proj: [T, hidden]."""
        return self.o_proj(attention_out.reshape(attention_out.shape[0], -1))


class DecoderMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, gate and up in one matmul (GeGLU with the tanh
    GELU where the config's activation says so: Gemma)."""

    def __init__(self, config: Any, par: ParallelContext, prefix: str, *, bias: bool,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        self.activation = mlp_activation(config)
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size],
                                                       bias=bias,
                                                       **par.linear_args(f"{prefix}.gate_up_proj"))
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias,
                                           **par.linear_args(f"{prefix}.down_proj",
                                                             with_group=True))
        # The backend's fused kernel where it has one (DecoderForCausalLM.use_kernels).
        self.act_and_mul: Callable[[torch.Tensor], torch.Tensor] = (
            silu_and_mul if self.activation == "silu" else gelu_tanh_and_mul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


# The gated MLP activations served: HF's names -> the gate's function.
MLP_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def mlp_activation(config: Any) -> str:
    """The gate's activation (Gemma names it ``hidden_activation``, the others ``hidden_act``);
    a ValueError naming one that is not served."""
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if act not in MLP_ACTIVATIONS:
        raise ValueError(f"unsupported hidden activation {act!r}; served: "
                         f"{', '.join(MLP_ACTIVATIONS)}")
    return act


def check_silu(config: Any) -> None:
    """A ValueError unless the MLP's activation is SiLU (the experts' fused kernels' only)."""
    act = mlp_activation(config)
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r} for a mixture of experts; only "
                         f"'silu' is supported")


class DecoderLayer(nn.Module):
    """Pre-norm attention then ``mlp`` (dense or a mixture of experts), each with a residual."""

    def __init__(self, config: Any, par: ParallelContext, prefix: str, mlp: nn.Module, *,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, par, f"{prefix}.self_attn", qkv_bias=qkv_bias,
                                          o_bias=o_bias, qk_norm=qk_norm)
        self.mlp = mlp
        eps = config.rms_norm_eps
        self.input_layernorm = par.norm(config.hidden_size, eps, dtype=par.dtype,
                                        device=par.device)
        self.post_attention_layernorm = par.norm(config.hidden_size, eps, dtype=par.dtype,
                                                 device=par.device)

    def before_attention(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                         cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer up to its attention op: (q, k, v, residual stream entering the layer plus
        ``hidden_states``). ``residual`` None: the first layer, whose input is the residual."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        q, k, v = self.self_attn.project_qkv(hidden_states, cos, sin)
        return q, k, v, residual

    def after_attention(self, attention_out: torch.Tensor, residual: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after its attention op: (MLP output, residual stream), the next layer's
        inputs."""
        hidden_states = self.self_attn.project_out(attention_out)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def forward(self, layer_idx: int, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor, sin: torch.Tensor, attn_meta: AttentionMetadata,
                kv_cache: KVCache, attention_op: AttentionOp
                ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, residual = self.before_attention(hidden_states, residual, cos, sin)
        return self.after_attention(attention_op(layer_idx, q, k, v, attn_meta, kv_cache),
                                    residual)


class DecoderModel(nn.Module):
    def __init__(self, config: Any, par: ParallelContext, layers: Sequence[DecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   **par.args(with_group=True))
        self.layers = nn.ModuleList(layers)
        self.norm = par.norm(config.hidden_size, config.rms_norm_eps, dtype=par.dtype,
                             device=par.device)
        # One rotary table for every layer ("all"); where layer types rotate differently
        # (Gemma 3: a local base for sliding layers), one per type. Each layer's table's key:
        self.layer_rope_kind: list[str] = (layer_rope_types(config)
                                           or ["all"] * config.num_hidden_layers)
        self.rotary_embs = nn.ModuleDict({
            kind: get_rotary_embedding(config, head_dim_of(config), dtype=par.dtype,
                                       device=par.device,
                                       layer_type=None if kind == "all" else kind)
            for kind in sorted(set(self.layer_rope_kind))})
        # The first layer's table (every layer's in most families).
        self.rotary_emb = self.rotary_embs[self.layer_rope_kind[0]]
        # What the token embeddings are multiplied by (Gemma: sqrt(hidden) in the model
        # dtype); None: nothing.
        self.embed_scale: torch.Tensor | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings, scaled where the family scales them."""
        hidden_states = self.embed_tokens(input_ids)
        return hidden_states if self.embed_scale is None else hidden_states * self.embed_scale

    def rope_tables(self, positions: torch.Tensor
                    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos and sin of the positions for each rotary table (layer_rope_kind's keys)."""
        return {kind: rotary(positions) for kind, rotary in self.rotary_embs.items()}


@dataclass
class LayerJoin:
    """A prefill chunk resuming a suspended pass: the inputs of ``layer`` for its tokens."""

    layer: int
    hidden_states: torch.Tensor
    residual: torch.Tensor

    def append_to(self, hidden_states: torch.Tensor | None, residual: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        if hidden_states is None or residual is None:
            return self.hidden_states, self.residual
        return (torch.cat([hidden_states, self.hidden_states]),
                torch.cat([residual, self.residual]))


class DecoderForCausalLM(nn.Module):
    """A causal LM over a paged KV cache. See ``workers.models`` for the API."""

    # Per-family switches, overridden by the families' subclasses.
    qkv_bias_always: ClassVar[bool] = False  # Qwen2: q/k/v always have a bias, o_proj never
    qk_norm: ClassVar[bool] = False  # Qwen3: RMSNorm over head_dim on q and k before rotary
    # HF name fragment -> ours, for modules a family names its own way (Mixtral's MoE block).
    checkpoint_renames: ClassVar[dict[str, str]] = {}
    # Whether HF's modeling of the family reads layer_types (which layers slide); Mistral's and
    # Mixtral's ignore them and slide every layer when the config has a window.
    reads_layer_types: ClassVar[bool] = True
    # gpt-oss: a learned logit per attention head beside its keys (DecoderAttention.add_sinks).
    attention_sinks: ClassVar[bool] = False
    # The family's layer (where its norms sit around attention and MLP) and RMSNorm.
    layer_class: ClassVar[type[DecoderLayer]] = DecoderLayer
    norm_class: ClassVar[type[RMSNorm]] = RMSNorm

    def __init__(self, config: Any, *, dtype: torch.dtype, device: torch.device | str,
                 tp_rank: int = 0, tp_size: int = 1,
                 tp_group: dist.ProcessGroup | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.check_config(config)
        self.config = config
        device = torch.device(device)
        par = ParallelContext(dtype, device, tp_rank, tp_size, tp_group, quant_config)
        par.norm = self.norm_class
        self.quant_config = quant_config
        attention_bias = bool(getattr(config, "attention_bias", False))
        layers = [self.layer_class(config, par, f"model.layers.{i}",
                                   self.make_mlp(config, par, i, f"model.layers.{i}.mlp"),
                                   qkv_bias=self.qkv_bias_always or attention_bias,
                                   o_bias=attention_bias and not self.qkv_bias_always,
                                   qk_norm=self.qk_norm)
                  for i in range(config.num_hidden_layers)]
        if self.attention_sinks:
            for layer in layers:
                layer.self_attn.add_sinks()
        # Each layer's sinks, handed to its attention kernel (None: none).
        self.layer_sinks: list[torch.Tensor | None] = [layer.self_attn.sinks for layer in layers]
        self.model = DecoderModel(config, par, layers)
        embed_scale = self.embedding_scale(config)
        if embed_scale is not None:
            # HF's cast: sqrt(3072) is 55.4256 in float32 and 55.5 in bf16.
            self.model.embed_scale = torch.tensor(embed_scale, device=device).to(dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                      **par.args(with_group=True))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

        attn = self.model.layers[0].self_attn
        self.num_layers: int = config.num_hidden_layers
        self.num_kv_heads: int = attn.num_kv_heads  # local to this rank
        self.head_dim: int = attn.head_dim
        self.vocab_size: int = config.vocab_size
        self.scale: float = self.attention_scale(config, self.head_dim)
        # Gemma 2's tanh soft-caps (None: none) of the attention scores, handed to the kernel,
        # and of the final logits, applied as HF does.
        self.attn_softcap: float | None = getattr(config, "attn_logit_softcapping", None)
        self.final_logit_softcap: float | None = getattr(config, "final_logit_softcapping",
                                                         None)
        # Each layer's sliding window (None: full attention), handed to its attention kernel.
        self.layer_windows: list[int | None] = self.sliding_windows(config)
        # The layers sharing a KV block table (engine.core.kv_groups), as the engine's
        # scheduler groups them; each layer's group, whose metadata its attention reads.
        self.kv_cache_groups: list[KVCacheGroup] = kv_cache_groups(self.layer_windows)
        self.layer_kv_group: list[int] = [g for g, _ in layer_groups(self.kv_cache_groups)]
        self.dtype, self.device = dtype, device
        # Called with the layer index before every attention op (the preemption vote); None is
        # the common case and costs one attribute check per layer.
        self.before_attention: Callable[[int], None] | None = None
        self.kernels: KernelBackend = select_backend(device)
        self.use_kernels(self.kernels)

    def make_mlp(self, config: Any, par: ParallelContext, layer_idx: int,
                 prefix: str) -> nn.Module:
        """What follows attention in layer ``layer_idx``: the dense SwiGLU MLP here."""
        return DecoderMLP(config, par, prefix, bias=bool(getattr(config, "mlp_bias", False)))

    @classmethod
    def check_config(cls, config: Any) -> None:
        """A ValueError for a config this implementation would not compute exactly."""
        cls.sliding_windows(config)
        cap = getattr(config, "attn_logit_softcapping", None)
        if cap is not None and not (isinstance(cap, (int, float)) and cap > 0):
            raise ValueError(f"attn_logit_softcapping must be a positive number, got {cap!r}")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("bidirectional attention (use_bidirectional_attention: an "
                             "embedding model) is not served")

    @staticmethod
    def attention_scale(config: Any, head_dim: int) -> float:
        """What q.k is multiplied by before the softmax."""
        return head_dim ** -0.5

    @staticmethod
    def embedding_scale(config: Any) -> float | None:
        """What the token embeddings are multiplied by (None: nothing)."""
        return None

    @classmethod
    def sliding_windows(cls, config: Any) -> list[int | None]:
        """Each layer's sliding window as HF's modeling reads the config: where the config lists
        ``layer_types`` (Qwen2, Qwen3, Qwen2-MoE), its "sliding_attention" layers take
        ``sliding_window`` and the others attend fully; without them a ``sliding_window`` covers
        every layer (Qwen3-MoE). A window of None or 0 (Qwen2-MoE's "off") is no window."""
        layers = config.num_hidden_layers
        window = sliding_window_of(config)
        layer_types = getattr(config, "layer_types", None) if cls.reads_layer_types else None
        if not layer_types:
            return [window] * layers
        if len(layer_types) != layers:
            raise ValueError(f"layer_types lists {len(layer_types)} layers; the model has "
                             f"{layers}")
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"unsupported layer_types {unknown}: only 'full_attention' and "
                             f"'sliding_attention' layers are served")
        if window is None and "sliding_attention" in layer_types:
            if getattr(config, "use_sliding_window", True) is False:
                return [None] * layers  # HF: the window is off, whatever the types say
            raise ValueError("layer_types marks sliding_attention layers but the config has no "
                             "sliding_window")
        return [window if kind == "sliding_attention" else None for kind in layer_types]

    def use_kernels(self, kernels: KernelBackend) -> None:
        """Run attention, and the norms, rotary, SwiGLU activation and experts where the
        backend fuses them, on ``kernels``. Where the backend's fused ops serve this model (the
        CPU's: float32, not a tiny model) they also bring their own paged attention kernel;
        ``attention_op`` calls whichever it is, after the vote, as before."""
        # The CPU's fused ops serve float32 models past a size only, and compile here, at
        # load, the first time (kernels.cpu_fused); Triton's serve every model.
        fused = kernels.fused_for is None or kernels.fused_for(self.dtype,
                                                               self.config.hidden_size)
        if fused and kernels.fused_paged_attention is not None:
            # Still called from attention_op alone, after the vote: only the kernel changes.
            kernels = dataclasses.replace(kernels, paged_attention=kernels.fused_paged_attention,
                                          fused_paged_attention=None)
        self.kernels = kernels
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.fused = module.fused_kernel(kernels) if fused else None
            elif isinstance(module, DecoderAttention):
                # The fused rotary kernels turn whole heads: a partial rotary keeps the eager op.
                whole = self.model.rotary_emb.rotary_dim == module.head_dim
                module.apply_rotary = ((kernels.apply_rotary if fused and whole else None)
                                       or apply_rotary)
            elif isinstance(module, DecoderMLP):
                if module.activation == "silu":
                    module.act_and_mul = ((kernels.silu_and_mul if fused else None)
                                          or silu_and_mul)
                else:
                    module.act_and_mul = ((kernels.gelu_tanh_and_mul if fused else None)
                                          or gelu_tanh_and_mul)
            elif hasattr(module, "use_kernels") and module is not self:
                module.use_kernels(kernels)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_meta: AttentionMetadata, kv_caches: list[KVCache],
                joins: Sequence[LayerJoin] = ()) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for a flattened batch (see kernels.attention
        for the token order).

        ``joins`` resume suspended passes: they are the batch's last prefill chunks, in order of
        their layer, and ``input_ids`` covers only the tokens before them. Each enters the
        residual stream at its layer with the activations saved when its pass stopped, so the
        layers below it run without it. If the pass is unwound (StepSLOPreempted), the exception
        carries the inputs of the layer it stopped at (``hidden_states``/``residual``, the rows
        of the tokens active there), which is what a suspended chunk resumes from.
        """
        tables = self.model.rope_tables(positions)
        rope_kind = self.model.layer_rope_kind
        pending = list(joins)
        hidden_states: torch.Tensor | None = None
        residual: torch.Tensor | None = None
        first_layer = pending[0].layer if pending else 0
        if input_ids.numel() > 0:
            hidden_states = self.model.embed(input_ids)
            first_layer = 0
        meta = attn_meta.without_last_prefills(len(pending))
        attention_op = self.attention_op
        try:
            for layer_idx in range(first_layer, self.num_layers):
                if pending and pending[0].layer == layer_idx:
                    while pending and pending[0].layer == layer_idx:
                        hidden_states, residual = pending.pop(0).append_to(hidden_states,
                                                                           residual)
                    meta = attn_meta.without_last_prefills(len(pending))
                assert hidden_states is not None
                # The rows of the tokens active at the layer: all of them, or fewer below a
                # join's layer.
                n = hidden_states.shape[0]
                layer_cos, layer_sin = tables[rope_kind[layer_idx]]
                if layer_cos.shape[0] != n:
                    layer_cos, layer_sin = layer_cos[:n], layer_sin[:n]
                hidden_states, residual = self.model.layers[layer_idx](
                    layer_idx, hidden_states, residual, layer_cos, layer_sin, meta,
                    kv_caches[layer_idx], attention_op)
        except StepSLOPreempted as stop:
            stop.hidden_states, stop.residual = hidden_states, residual
            raise
        assert hidden_states is not None and not pending
        hidden_states, _ = self.model.norm(hidden_states, residual)
        return hidden_states

    def attention_op(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     attn_meta: AttentionMetadata, kv_cache: KVCache,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """The single entry point of every attention computation: the boundary (the vote),
        then the cache write and the attention (into ``out`` when given)."""
        self.attention_boundary(layer_idx, q.shape[0])
        return self.attend(layer_idx, q, k, v, attn_meta, kv_cache, out)

    def attention_boundary(self, layer_idx: int, num_tokens: int) -> None:
        """The point before layer ``layer_idx``'s attention where Python runs in every kind of
        step that may be stopped, eager or replayed as captured pieces: the vote
        (``before_attention``). ``num_tokens``: the tokens active at the layer, padding
        excluded (observers read it: workers.preemption.layer_delay)."""
        hook = self.before_attention
        if hook is not None:
            hook(layer_idx)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_meta: AttentionMetadata, kv_cache: KVCache,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer ``layer_idx``'s cache write and attention, with no vote: what a captured piece
        runs after the boundary (workers.graphs.piecewise_graphs)."""
        key_cache, value_cache = kv_cache
        attn_meta = attn_meta.for_group(self.layer_kv_group[layer_idx])
        kernels = self.kernels
        kernels.write_kv_cache(k, v, key_cache, value_cache, attn_meta.slot_mapping)
        return kernels.paged_attention(q, k, v, key_cache, value_cache, attn_meta, self.scale,
                                       out=out, sliding_window=self.layer_windows[layer_idx],
                                       softcap=self.attn_softcap,
                                       sinks=self.layer_sinks[layer_idx])

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the rows to sample (never every prompt position)."""
        logits = self.lm_head(hidden_states)
        cap = self.final_logit_softcap
        if cap is not None:
            # In the model dtype, as HF: logits / cap, tanh, * cap.
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


def sliding_window_of(config: Any) -> int | None:
    """The config's sliding window, None where it has none (None, 0, or use_sliding_window
    false); a ValueError naming a window that is not a positive integer."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    return window
