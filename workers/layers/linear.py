"""Tensor-parallel linear layers (Megatron/vLLM sharding) and their weight loaders.

Each parameter carries ``weight_loader(param, loaded_weight, shard_id=None)`` which takes the FULL
checkpoint tensor and copies this rank's slice into place; merged layers (qkv, gate_up) take one
checkpoint tensor per shard_id. With tp_size == 1 every slice is the whole tensor. Where each
shard's slice comes from and goes to is one method, ``shard_slice(shard_id)``, which quantized
weights and their scales reuse.

A layer built with a ``quant_method`` (``workers.quantization``: FP8 weights) holds no
model-dtype ``weight``: the method registers the parameters the checkpoint names (``weight`` in
float8 with ``weight_scale_inv`` or ``weight_scale``, ...), finishes them in its
``process_weights_after_loading(layer)`` (the weight loader calls it on every module with a
``quant_method``, once all weights are in) and multiplies by them in ``forward``.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from kernels.cpu_bf16_linear import Bf16Weight
from workers.layers.cpu_prepack import linear

WeightLoader = Callable[..., None]


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp_size ({denominator})")
    return numerator // denominator


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor,
                          shard_id: Any = None) -> None:
    """Copy a replicated (unsharded) weight whole; casts to the parameter's dtype."""
    if shard_id is not None:
        raise ValueError(f"unexpected shard_id {shard_id!r} for an unsharded parameter")
    _copy_checked(param.data, loaded_weight)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight shape mismatch: expected {tuple(dst.shape)}, "
                         f"checkpoint slice has {tuple(src.shape)}")
    dst.copy_(src)


def weakly_bound(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, where a bound method is called through a weak reference to its object (any
    other callable is returned as it is). For a callable that the object itself keeps, such as
    a parameter's ``weight_loader`` (a method of the module that owns the parameter): a bound
    method there would make module -> parameter -> method -> module a reference cycle, and every
    weight would outlive its model until the garbage collector ran (on a GPU, the next engine
    in the process would find its memory still taken)."""
    if not isinstance(method, types.MethodType):
        return method
    owner_ref = weakref.ref(method.__self__)
    function = method.__func__

    def call(*args: Any, **kwargs: Any) -> Any:
        owner = owner_ref()
        if owner is None:
            raise RuntimeError(f"{function.__qualname__}: its object is gone")
        return function(owner, *args, **kwargs)

    return call


def _new_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
               loader: WeightLoader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = weakly_bound(loader)  # type: ignore[attr-defined]
    return param


@dataclass(frozen=True)
class ShardSlice:
    """Where this rank's part of one checkpoint tensor goes: ``size`` entries along ``dim``
    starting at ``start`` in the full checkpoint tensor land at ``offset`` in this rank's
    parameter. ``dim`` 0 is the output rows (column-parallel layers), 1 the input columns
    (row-parallel)."""

    dim: int
    offset: int
    start: int
    size: int


class LinearMethod(Protocol):
    """How a quantized linear layer holds and multiplies its weights (workers.quantization)."""

    def create_weights(self, layer: LinearBase, dtype: torch.dtype,
                       device: torch.device) -> None: ...

    def process_weights_after_loading(self, layer: LinearBase) -> None: ...

    def apply(self, layer: LinearBase, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor: ...


class LinearBase(nn.Module):
    """What the column- and row-parallel layers share: the weight (model dtype, or what a
    ``quant_method`` registers in its place), the bias, and the multiplication."""

    prepack_weight = True  # see workers.layers.cpu_prepack
    # The kernel workers.layers.cpu_prepack gave the weight (None: not yet), and with "both" the
    # packed copy that multiplies inputs of packed_min_rows rows or more.
    linear_kernel: str | None = None
    packed_weight: torch.Tensor | None = None
    packed_min_rows = 0
    # The weight's bfloat16 copy for steps of up to bf16_max_rows rows, where every value is
    # bfloat16 (workers.layers.cpu_bf16_weights; None: none).
    bf16_weight: Bf16Weight | None = None
    bf16_max_rows = 0
    # The checkpoint's shard ids of a merged layer, in their order in the local weight.
    shard_ids: tuple[Any, ...] = (None,)

    def __init__(self, input_size_per_partition: int, output_size_per_partition: int, *,
                 dtype: torch.dtype, device: torch.device | str, tp_rank: int, tp_size: int,
                 quant_method: LinearMethod | None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.input_size_per_partition = input_size_per_partition
        self.output_size_per_partition = output_size_per_partition
        self.params_dtype = dtype
        self.quant_method = quant_method
        if quant_method is None:
            self.weight = _new_param((output_size_per_partition, input_size_per_partition),
                                     dtype, device, self.weight_loader)
        else:
            # oneDNN packs float32 weights only; a quantized weight is multiplied by its method.
            self.prepack_weight = False
            quant_method.create_weights(self, dtype, torch.device(device))

    def shard_slice(self, shard_id: Any) -> ShardSlice:
        raise NotImplementedError

    def checkpoint_shard_sizes(self) -> list[int] | None:
        """The rows of each shard in a checkpoint that stores this merged layer fused (Phi-3's
        ``qkv_proj``, ``gate_up_proj``), in ``shard_ids`` order; None: not merged."""
        return None

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor,
                      shard_id: Any = None) -> None:
        sizes = self.checkpoint_shard_sizes() if shard_id is None else None
        if sizes is not None and param.dim() >= 1:
            # One checkpoint tensor for the whole merged layer: each shard's rows in turn.
            if loaded_weight.shape[0] != sum(sizes):
                raise ValueError(f"{type(self).__name__}: a fused tensor of {loaded_weight.shape[0]} "
                                 f"rows; its shards {list(self.shard_ids)} hold {sizes}")
            for sid, part in zip(self.shard_ids, torch.split(loaded_weight, sizes, dim=0)):
                self.weight_loader(param, part, sid)
            return
        where = self.shard_slice(shard_id)
        if where.dim >= param.dim():  # a column-parallel layer's bias: sliced as its rows
            raise ValueError(f"{type(self).__name__}: a {param.dim()}-d parameter cannot be "
                             f"sliced along dim {where.dim}")
        _copy_checked(param.data.narrow(where.dim, where.offset, where.size),
                      loaded_weight.narrow(where.dim, where.start, where.size))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        return linear(x, self.weight, bias, self.packed_weight, self.packed_min_rows,
                      self.bf16_weight, self.bf16_max_rows)


class ColumnParallelLinear(LinearBase):
    """y = x W^T + b with W's output rows split across ranks; each rank keeps its slice of y."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool, dtype: torch.dtype,
                 device: torch.device | str, tp_rank: int = 0, tp_size: int = 1,
                 quant_method: LinearMethod | None = None) -> None:
        self.input_size = input_size
        super().__init__(input_size, divide(output_size, tp_size, "output size"), dtype=dtype,
                         device=device, tp_rank=tp_rank, tp_size=tp_size,
                         quant_method=quant_method)
        self.bias = (_new_param((self.output_size_per_partition,), dtype, device,
                                self.weight_loader) if bias else None)

    def shard_slice(self, shard_id: Any) -> ShardSlice:
        if shard_id is not None:
            raise ValueError(f"unexpected shard_id {shard_id!r} for {type(self).__name__}")
        size = self.output_size_per_partition
        return ShardSlice(dim=0, offset=0, start=self.tp_rank * size, size=size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out_per_rank={self.output_size_per_partition}, "
                f"tp={self.tp_rank}/{self.tp_size}")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate/up). Each rank's
    weight is [shard0 slice; shard1 slice; ...]; shard_id is the index into output_sizes."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], *, bias: bool,
                 dtype: torch.dtype, device: torch.device | str, tp_rank: int = 0,
                 tp_size: int = 1, quant_method: LinearMethod | None = None) -> None:
        self.local_sizes = [divide(s, tp_size, "merged output size") for s in output_sizes]
        self.shard_ids = tuple(range(len(output_sizes)))
        super().__init__(input_size, sum(output_sizes), bias=bias, dtype=dtype, device=device,
                         tp_rank=tp_rank, tp_size=tp_size, quant_method=quant_method)

    def checkpoint_shard_sizes(self) -> list[int] | None:
        return [size * self.tp_size for size in self.local_sizes]

    def shard_slice(self, shard_id: Any) -> ShardSlice:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.local_sizes):
            raise ValueError(f"shard_id must be an index below {len(self.local_sizes)}, "
                             f"got {shard_id!r}")
        size = self.local_sizes[shard_id]
        return ShardSlice(dim=0, offset=sum(self.local_sizes[:shard_id]),
                          start=self.tp_rank * size, size=size)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, heads split across ranks. Each rank's output is
    [its q heads | its kv heads (k) | its kv heads (v)].

    With fewer KV heads than ranks, each KV head is replicated on tp_size / num_kv_heads ranks
    (one KV head per rank), as vLLM does.
    """

    shard_ids = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, *, bias: bool, dtype: torch.dtype,
                 device: torch.device | str, tp_rank: int = 0, tp_size: int = 1,
                 quant_method: LinearMethod | None = None) -> None:
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "number of attention heads")
        if total_num_kv_heads >= tp_size:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "number of KV heads")
            self.num_kv_head_replicas = 1
        else:
            if tp_size % total_num_kv_heads != 0:
                raise ValueError(f"tp_size ({tp_size}) must be a multiple of the number of KV "
                                 f"heads ({total_num_kv_heads}) when it exceeds it")
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp_size // total_num_kv_heads
        # Set before the base class builds the weights: a quant method slices by them.
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        # The output size handed to the base class is the per-rank size times tp_size, so
        # replicated KV heads count once per rank.
        total_out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, total_out, bias=bias, dtype=dtype, device=device,
                         tp_rank=tp_rank, tp_size=tp_size, quant_method=quant_method)

    def checkpoint_shard_sizes(self) -> list[int] | None:
        kv = self.total_num_kv_heads * self.head_dim
        return [self.total_num_heads * self.head_dim, kv, kv]

    def shard_slice(self, shard_id: Any) -> ShardSlice:
        if shard_id == "q":
            return ShardSlice(dim=0, offset=0, start=self.tp_rank * self.q_size,
                              size=self.q_size)
        if shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            start = (self.tp_rank // self.num_kv_head_replicas) * self.kv_size
            return ShardSlice(dim=0, offset=offset, start=start, size=self.kv_size)
        raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")


class RowParallelLinear(LinearBase):
    """y = x W^T + b with W's input columns split across ranks: each rank multiplies its slice of
    x (the column-parallel layer's output) and the partial sums are all-reduced over tp_group.
    The bias is added once, after the reduction."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool, dtype: torch.dtype,
                 device: torch.device | str, tp_rank: int = 0, tp_size: int = 1,
                 tp_group: dist.ProcessGroup | None = None,
                 quant_method: LinearMethod | None = None) -> None:
        self.tp_group = tp_group
        self.output_size = output_size
        super().__init__(divide(input_size, tp_size, "input size"), output_size, dtype=dtype,
                         device=device, tp_rank=tp_rank, tp_size=tp_size,
                         quant_method=quant_method)
        self.bias = (_new_param((output_size,), dtype, device, default_weight_loader)
                     if bias else None)

    def shard_slice(self, shard_id: Any) -> ShardSlice:
        if shard_id is not None:
            raise ValueError(f"unexpected shard_id {shard_id!r} for {type(self).__name__}")
        size = self.input_size_per_partition
        return ShardSlice(dim=1, offset=0, start=self.tp_rank * size, size=size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.matmul(x, self.bias)
        out = self.matmul(x, None)
        dist.all_reduce(out, group=self.tp_group)
        if self.bias is not None:
            out = out + self.bias
        return out

    def extra_repr(self) -> str:
        return (f"in_per_rank={self.input_size_per_partition}, out={self.output_size}, "
                f"tp={self.tp_rank}/{self.tp_size}")
