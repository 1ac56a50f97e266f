"""Triton kernels: the SwiGLU experts of a mixture-of-experts layer, fused (after vLLM's fused_moe).

Same contract as :func:`fused_experts_reference` (HF's Mixtral/Qwen-MoE sparse block): for each
token t and each of its K routing slots k, with ``e = topk_ids[t, k]``, the expert's SwiGLU MLP
``y = (silu(x[t] @ gate[e].T) * (x[t] @ up[e].T)) @ down[e].T`` is scaled by
``topk_weights[t, k]``, rounded to the model dtype, and the K contributions of a token are summed
in float32 and rounded once. ``w13`` is HF's fused gate_up layout [E, 2 * I, H] (gate rows first)
and ``w2`` the down projection [E, H, I].

Why fused: the eager loop over experts launches a handful of kernels per *hit expert* (a gather,
three GEMMs, the activation, a scale, an index_add), and the number of hit experts is data
dependent, which a CUDA graph cannot capture. Here the whole layer is a fixed sequence of
launches whose shapes depend only on the input shapes:

1. Alignment (:func:`moe_align_block_size`, torch ops): the T * K (token, slot) *pairs* are
   grouped by expert and each expert's group is padded to a multiple of BLOCK_M, so every
   BLOCK_M-row block of the sorted order belongs to one expert. It never synchronises with the
   host (no ``.item()``, ``.tolist()``, ``nonzero()``, nothing with a data-dependent shape): the
   sorted buffer has the static size ``N + min(N, E) * (BLOCK_M - 1)`` rounded up to BLOCK_M
   (N = T * K; at most min(N, E) experts are hit, each padded by at most BLOCK_M - 1 rows),
   never more than the usual ``N + E * (BLOCK_M - 1)`` and much smaller for decode batches. The real
   padded row count stays on the device; the kernels' programs past it read it and exit at
   once. The whole function can therefore be captured in a CUDA graph.
2. Kernel 1, grouped GEMM with the activation fused: a program takes one block of sorted pairs
   (one expert) and one BLOCK_N tile of the intermediate dim, accumulates *both* the gate tile
   (rows n of w13) and the up tile (rows I + n) in float32 over H, and writes
   ``silu(gate) * up`` to an intermediate [N, I] buffer in the model dtype, at the pair's row.
   The [N, 2 * I] gate_up output never reaches memory.
3. Kernel 2, grouped GEMM with w2: the same blocks read their pairs' intermediate rows, multiply
   by the expert's down projection (float32 accumulation), scale by the pair's routing weight and
   write [N, H] in the model dtype, at the pair's row.
4. The K contributions of each token are summed with ``.view(T, K, H).sum(1)`` (torch reduces
   16-bit floats in float32 and rounds once; K = 1 returns kernel 2's buffer). Not fused into
   kernel 2: a token's K pairs belong to K different experts, hence to different programs, so a
   fused sum needs float32 atomics into an extra float32 buffer and a final cast: results that
   change from run to run (the atomics' order) for saving one read of an [N, H] buffer, a small
   part of the layer's traffic next to the expert weights.

The intermediate buffers are indexed by pair id, [N, I] and [N, H], not by sorted position: the
padded order has up to min(N, E) * (BLOCK_M - 1) extra rows (a decode step of 8 pairs pads to 128
rows with BLOCK_M = 16), which would only be written to be ignored.

Rounding follows HF's eager layers, as the project's other fused kernels do: the gate and up
projections are rounded to the model dtype (nn.Linear's output), ``F.silu`` is computed in
float32 and rounded, the product with up rounded, the down projection rounded, then its product
with the float32 routing weight rounded. Only the GEMMs' float32 summation order differs from
torch's, so a 16-bit result is torch's up to the rare value whose float32 sum straddles a rounding
boundary. A float32 model's GEMMs run as true float32 products (``input_precision="ieee"``),
never TF32.

gpt-oss's experts take the same path with two options: biases on both projections (added to
the float32 accumulators before the rounding, as addmm adds them) and its clamped SwiGLU,
``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``, each
op rounded as torch's eager ops round it (``activation="swigluoai"``, vLLM's name).

Inputs: hidden_states [T, H] with any row stride; the weights with any strides (a unit last
stride lets the loads vectorize). H and I need not be multiples of the block sizes: masks cover
the tails. topk_ids may be int32 or int64, and must lie in [0, E).

Runs compiled on CUDA, and on CPU under Triton's interpreter (TRITON_INTERPRET=1) for tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels.triton_norm import DTYPE_KIND, from_float32, round_float32_to, to_float32
from kernels.variants import launch

try:  # Compiled kernels only; the interpreter has no extern functions.
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - every Triton 3.x has it
    libdevice = None

# Tiles of the output columns and of the reduction dim. Fixed, never derived from the batch: each
# value is a compiled variant. 64 x 64 keeps the two float32 accumulators of kernel 1 (gate and
# up, BLOCK_M x BLOCK_N each) within registers at BLOCK_M = 64.
_BLOCK_N = 64
_BLOCK_K = 64
# The activations between the projections: SwiGLU, and gpt-oss's clamped SwiGLU (vLLM's name).
ACTIVATIONS = ("silu", "swigluoai")


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """BLOCK_M for N (token, slot) pairs over E experts: the rows a program computes, all of one
    expert. Every hit expert's group is padded to a multiple of it, so small batches (a few pairs
    per expert, decode) take 16 rows (the smallest tensor-core tile) to waste little, and large
    prefills take up to 64 to reuse each loaded weight tile across more rows. Three values, so at
    most three compiled variants per kernel and dtype; all of them depend on shapes only."""
    per_expert = num_pairs / max(num_experts, 1)
    if per_expert <= 16:
        return 16
    if per_expert <= 64:
        return 32
    return 64


def padded_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The static length of the sorted pair buffer: every pair, plus at most BLOCK_M - 1 padding
    rows for each expert that can be hit (no more than min(N, E) of them), rounded up to a whole
    number of blocks. A function of shapes only, never of the routing."""
    bound = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the (token, slot) pairs by expert, each group padded to a multiple of block_m.

    Pair ``p = t * K + k`` is routed to ``topk_ids[t, k]``. Returns, all on topk_ids' device:

    - sorted_pair_ids [padded_size(...)] int32: the pair ids, experts in increasing order and
      pairs in increasing order within an expert; padding slots (the tail of each group and
      everything past the last group) hold N, which no pair has.
    - block_expert_ids [padded_size(...) // block_m] int32: the expert of each block of block_m
      sorted slots (blocks past the real count are clamped to E - 1 and never computed).
    - num_padded [1] int32: how many sorted slots the groups fill (a multiple of block_m).

    Only torch ops with shape-determined outputs, and no read back to the host, so it can run
    inside a CUDA graph capture.
    """
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    # Per-expert counts by scatter_add: torch.bincount sizes its output by the largest id, which
    # on CUDA is read back to the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded_counts = (counts + (block_m - 1)) // block_m * block_m
    padded_end = torch.cumsum(padded_counts, 0)
    padded_start = padded_end - padded_counts
    start = torch.cumsum(counts, 0) - counts
    # A stable sort by expert keeps each expert's pairs in pair (token) order, so a block's rows
    # of hidden_states are read in increasing address order.
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    # The i-th sorted pair is the (i - start[e])-th of its expert e: it lands at that offset from
    # the start of the expert's padded group.
    rank = torch.arange(num_pairs, device=device) - start[expert_of]
    size = padded_size(num_pairs, num_experts, block_m)
    sorted_pair_ids = torch.full((size,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, padded_start[expert_of] + rank, order.to(torch.int32))
    # Block b starts at slot b * block_m; its expert is the first whose padded group ends past it.
    block_starts = torch.arange(0, size, block_m, dtype=torch.int64, device=device)
    block_expert_ids = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert_ids = block_expert_ids.clamp_(max=num_experts - 1).to(torch.int32)
    num_padded = padded_end[-1:].to(torch.int32)
    return sorted_pair_ids, block_expert_ids, num_padded


@triton.jit
def _dot(a, b, acc, KIND: tl.constexpr):
    """acc + a @ b in float32. A float32 model gets true float32 products ("ieee"), not TF32
    (Triton's default for float32 operands on a GPU, about 1e-3 off); 16-bit operands keep the
    default, tensor-core products, which are exact in float32."""
    if KIND == 0:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _load_operand(ptrs, mask, KIND: tl.constexpr, WIDEN: tl.constexpr):
    """A GEMM operand tile: as stored on the GPU (tensor cores multiply 16-bit floats exactly and
    accumulate in float32), widened to float32 in the interpreter, whose dot would otherwise
    multiply bfloat16's raw bits (it keeps bfloat16 as uint16). Both give the exact products."""
    v = tl.load(ptrs, mask=mask, other=0.0)
    if WIDEN:
        v = to_float32(v, KIND)
    return v


# num_pairs changes with the batch: specialized, 1 or a multiple of 16 would each compile their own
# variant mid-serving. Everything else is fixed by the model (TOP_K included).
@triton.jit
def _bias_row(b_ptr, row_start, offs, mask, KIND: tl.constexpr):
    """An expert's bias (its row starting at ``row_start``) over ``offs``, in float32."""
    return to_float32(tl.load(b_ptr + row_start + offs, mask=mask, other=0.0), KIND)


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_silu_kernel(x_ptr, w13_ptr, b13_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr,
                         num_padded_ptr, num_pairs, hidden, inter, stride_x_t,
                         stride_w_e, stride_w_n, stride_w_k, stride_b_e, alpha, limit,
                         TOP_K: tl.constexpr, KIND: tl.constexpr, WIDEN: tl.constexpr,
                         PRECISE_EXP: tl.constexpr, HAS_BIAS: tl.constexpr,
                         ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Axis 0 runs over the sorted blocks, fastest on the GPU: neighbouring programs are mostly
    # blocks of the same expert and the same n tile, so they share the weight tiles in L2.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # The grid covers the static bound; blocks past the real padded count have nothing to do.
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pair < num_pairs
    token = pair // TOP_K
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + (token * stride_x_t)[:, None] + offs_k[None, :]
    # [BLOCK_K, BLOCK_N] tiles of w13[e].T: the gate rows n, and the up rows I + n.
    g_ptrs = (w13_ptr + expert * stride_w_e + (offs_n * stride_w_n)[None, :]
              + (offs_k * stride_w_k)[:, None])
    u_ptrs = g_ptrs + inter * stride_w_n
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = offs_k < hidden - k0
        # Padding rows load zeros and are never stored; masked k lanes add zero products.
        a = _load_operand(a_ptrs, valid[:, None] & k_mask[None, :], KIND, WIDEN)
        w_mask = k_mask[:, None] & n_mask[None, :]
        acc_g = _dot(a, _load_operand(g_ptrs, w_mask, KIND, WIDEN), acc_g, KIND)
        acc_u = _dot(a, _load_operand(u_ptrs, w_mask, KIND, WIDEN), acc_u, KIND)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_w_k
        u_ptrs += BLOCK_K * stride_w_k
    # HF rounds the gate and up projections (nn.Linear outputs, the bias added before the
    # rounding as addmm adds it) to the model dtype, then each op of the activation on its own.
    if HAS_BIAS:
        b_row = expert * stride_b_e
        acc_g += _bias_row(b13_ptr, b_row, offs_n, n_mask, KIND)[None, :]
        acc_u += _bias_row(b13_ptr, b_row, inter + offs_n, n_mask, KIND)[None, :]
    gate = round_float32_to(acc_g, KIND)
    up = round_float32_to(acc_u, KIND)
    if ACTIVATION == 0:
        # SwiGLU: F.silu computes g / (1 + exp(-g)) in float32 and rounds, then the product
        # with up is rounded again.
        if PRECISE_EXP:
            e = libdevice.exp(-gate)  # torch's CUDA silu calls expf; Triton's exp is ex2.approx
        else:
            e = tl.exp(-gate)
        act = round_float32_to(tl.math.div_rn(gate, 1.0 + e), KIND)
        out = act * up
    else:
        # gpt-oss's clamped SwiGLU: (clamp(up, -l, l) + 1) * g * sigmoid(alpha g), g =
        # min(gate, l), each op rounded as torch's eager ops round it.
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        scaled = round_float32_to(gate * alpha, KIND)
        if PRECISE_EXP:
            e = libdevice.exp(-scaled)
        else:
            e = tl.exp(-scaled)
        sig = round_float32_to(tl.math.div_rn(1.0, 1.0 + e), KIND)
        glu = round_float32_to(gate * sig, KIND)
        out = round_float32_to(up + 1.0, KIND) * glu
    tl.store(out_ptr + (pair * inter)[:, None] + offs_n[None, :], from_float32(out, KIND),
             mask=valid[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_weighted_kernel(a_ptr, w2_ptr, b2_ptr, weights_ptr, out_ptr, sorted_ids_ptr,
                          block_expert_ptr, num_padded_ptr, num_pairs, hidden, inter,
                          stride_w_e, stride_w_n, stride_w_k, stride_b_e,
                          KIND: tl.constexpr, WIDEN: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pair < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    # The intermediate is indexed by pair id, [N, I] contiguous.
    a_ptrs = a_ptr + (pair * inter)[:, None] + offs_k[None, :]
    # [BLOCK_K, BLOCK_N] tile of w2[e].T.
    w_ptrs = (w2_ptr + expert * stride_w_e + (offs_n * stride_w_n)[None, :]
              + (offs_k * stride_w_k)[:, None])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_mask = offs_k < inter - k0
        a = _load_operand(a_ptrs, valid[:, None] & k_mask[None, :], KIND, WIDEN)
        w = _load_operand(w_ptrs, k_mask[:, None] & n_mask[None, :], KIND, WIDEN)
        acc = _dot(a, w, acc, KIND)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_w_k
    # HF: down_proj's output (its bias added first) in the model dtype, times the routing
    # weight (torch promotes a float32 one's product to float32), rounded to the model dtype
    # before the sum over the K slots.
    if HAS_BIAS:
        acc += _bias_row(b2_ptr, expert * stride_b_e, offs_n, n_mask, KIND)[None, :]
    y = round_float32_to(acc, KIND)
    weight = tl.load(weights_ptr + pair, mask=valid, other=0.0)
    tl.store(out_ptr + (pair * hidden)[:, None] + offs_n[None, :],
             from_float32(y * weight[:, None], KIND), mask=valid[:, None] & n_mask[None, :])


# Decided when the kernels were decorated (on import), as Triton decides it.
_INTERPRETED = isinstance(_gate_up_silu_kernel, InterpretedFunction)


def _check(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
           topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be [T, H], got shape {tuple(hidden_states.shape)}")
    num_tokens, hidden = hidden_states.shape
    if w13.dim() != 3 or w13.shape[2] != hidden or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2 * I, H={hidden}], got shape {tuple(w13.shape)}")
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(f"w2 must be [E={num_experts}, H={hidden}, I={inter}], got shape "
                         f"{tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids must be [T={num_tokens}, K], got shape {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)}, topk_ids "
                         f"{tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if hidden_states.dtype not in DTYPE_KIND:
        raise ValueError(f"unsupported dtype {hidden_states.dtype}; supported: "
                         f"{', '.join(map(str, DTYPE_KIND))}")
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype != hidden_states.dtype:
            raise ValueError(f"{name} dtype {w.dtype} differs from hidden_states' "
                             f"{hidden_states.dtype}")
    devices = {t.device for t in (hidden_states, w13, w2, topk_weights, topk_ids)}
    if len(devices) != 1:
        raise ValueError(f"inputs are on several devices: {sorted(map(str, devices))}")


def _check_biases(w13: torch.Tensor, w2: torch.Tensor, w13_bias: torch.Tensor | None,
                  w2_bias: torch.Tensor | None, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; known: {', '.join(ACTIVATIONS)}")
    for name, bias, shape in (("w13_bias", w13_bias, w13.shape[:2]),
                              ("w2_bias", w2_bias, w2.shape[:2])):
        if bias is None:
            continue
        if tuple(bias.shape) != tuple(shape):
            raise ValueError(f"{name} must be [E, {shape[1]}], got shape {tuple(bias.shape)}")
        if bias.dtype != w13.dtype or bias.device != w13.device:
            raise ValueError(f"{name} is {bias.dtype} on {bias.device}, the weights "
                             f"{w13.dtype} on {w13.device}")


def _fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   block_m: int | None = None, *, w13_bias: torch.Tensor | None = None,
                   w2_bias: torch.Tensor | None = None, activation: str = "silu",
                   alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """fused_experts with BLOCK_M chosen by the caller (tests), else by :func:`block_m_for`."""
    _check(hidden_states, w13, w2, topk_weights, topk_ids)
    _check_biases(w13, w2, w13_bias, w2_bias, activation)
    num_tokens, hidden = hidden_states.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    dtype, device = hidden_states.dtype, hidden_states.device
    if num_pairs == 0 or hidden == 0:
        return torch.zeros((num_tokens, hidden), dtype=dtype, device=device)
    block_m = block_m or block_m_for(num_pairs, num_experts)
    sorted_ids, block_expert, num_padded = moe_align_block_size(topk_ids, num_experts, block_m)
    # Rows are addressed through their stride; the lanes need a unit column stride.
    x = hidden_states if hidden_states.stride(1) == 1 else hidden_states.contiguous()
    # Pair p = t * K + k reads weight p: the [T, K] layout, contiguous, in float32.
    weights = topk_weights.to(torch.float32).contiguous()
    kind = DTYPE_KIND[dtype]
    num_blocks = sorted_ids.shape[0] // block_m
    common = {"KIND": kind, "WIDEN": _INTERPRETED, "BLOCK_M": block_m, "BLOCK_N": _BLOCK_N,
              "BLOCK_K": _BLOCK_K, "num_warps": 4,
              # No fused multiply-adds in the epilogues: torch rounds each op on its own.
              "enable_fp_fusion": False}
    activated = torch.empty((num_pairs, inter), dtype=dtype, device=device)
    # Without a bias the kernels read none: any tensor stands in for the pointer.
    b13 = (w13_bias if w13_bias is None or w13_bias.stride(1) == 1
           else w13_bias.contiguous())
    b2 = w2_bias if w2_bias is None or w2_bias.stride(1) == 1 else w2_bias.contiguous()
    if inter:
        launch(_gate_up_silu_kernel, (num_blocks, triton.cdiv(inter, _BLOCK_N)),
               x, w13, w13 if b13 is None else b13, activated, sorted_ids, block_expert,
               num_padded, num_pairs, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1),
               w13.stride(2), 0 if b13 is None else b13.stride(0), float(alpha), float(limit),
               TOP_K=top_k, PRECISE_EXP=libdevice is not None and not _INTERPRETED,
               HAS_BIAS=b13 is not None, ACTIVATION=ACTIVATIONS.index(activation), **common)
    per_pair = torch.empty((num_pairs, hidden), dtype=dtype, device=device)
    launch(_down_weighted_kernel, (num_blocks, triton.cdiv(hidden, _BLOCK_N)),
           activated, w2, w2 if b2 is None else b2, weights, per_pair, sorted_ids, block_expert,
           num_padded, num_pairs, hidden, inter, w2.stride(0), w2.stride(1), w2.stride(2),
           0 if b2 is None else b2.stride(0), HAS_BIAS=b2 is not None, **common)
    if top_k == 1:
        return per_pair
    # torch sums 16-bit floats in float32 and rounds once: the reference's float32 accumulation.
    return per_pair.view(num_tokens, top_k, hidden).sum(1)


def fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                  w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  activation: str = "silu", alpha: float = 1.702,
                  limit: float = 7.0) -> torch.Tensor:
    """The SwiGLU experts of an MoE layer for routed tokens, without a host sync.

    hidden_states [T, H] (bf16/fp16/fp32), w13 [E, 2 * I, H] (gate rows, then up rows), w2
    [E, H, I], topk_weights [T, K] (float32), topk_ids [T, K] (int32/int64, in [0, E)). Returns a
    new [T, H] tensor in hidden_states' dtype: per token, the sum over its K slots of the
    routing weight times its expert's ``down(silu(gate(x)) * up(x))``.

    gpt-oss's experts: biases ``w13_bias`` [E, 2 * I] (gate then up) and ``w2_bias`` [E, H]
    added to the projections, and ``activation="swigluoai"``: ``(clamp(up, -limit, limit) + 1)
    * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``.
    """
    return _fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, w13_bias=w13_bias,
                          w2_bias=w2_bias, activation=activation, alpha=alpha, limit=limit)


def fused_experts_reference(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                            topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The PyTorch reference: HF's loop over the hit experts (Mixtral's sparse MoE block).

    Each expert's MLP runs in the model dtype as HF's nn.Linear layers do; the weighted output
    ``(y * topk_weights).to(dtype)`` of every (token, slot) is accumulated in float32 and the sum
    rounded once (HF index_adds in the model dtype, rounding after each expert). Reads the hit
    experts back to the host: a test reference, not for serving.
    """
    _check(hidden_states, w13, w2, topk_weights, topk_ids)
    num_tokens, hidden = hidden_states.shape
    inter = w13.shape[1] // 2
    out = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=hidden_states.device)
    for expert in torch.unique(topk_ids).tolist():
        tokens, slots = torch.where(topk_ids == expert)
        x = hidden_states[tokens]
        gate_up = x @ w13[expert].T
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = act @ w2[expert].T
        # float32 weights promote the product to float32; HF rounds it before the index_add.
        contribution = (y * topk_weights[tokens, slots, None].to(torch.float32)).to(y.dtype)
        out.index_add_(0, tokens, contribution.to(torch.float32))
    return out.to(hidden_states.dtype)


def warm_up_experts(w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                    **options: object) -> None:
    """Launch every variant :func:`block_m_for` can choose for weights of this kind (BLOCK_M 16,
    32 and 64) at the layer's ``top_k`` (a compile-time constant), so no step compiles one while
    serving: the largest needs a prefill of thousands of tokens to be chosen, which a startup
    warm-up step does not make. ``w13``/``w2`` need only the layer's first ``top_k`` experts
    (``options``: the layer's biases for those experts and its activation, as
    :func:`fused_experts` takes them)."""
    device, dtype = w13.device, w13.dtype
    hidden = torch.zeros((1, w13.shape[2]), dtype=dtype, device=device)
    weights = torch.full((1, top_k), 1.0 / top_k, dtype=torch.float32, device=device)
    ids = torch.arange(top_k, dtype=torch.int64, device=device).unsqueeze(0)
    for block_m in (16, 32, 64):
        _fused_experts(hidden, w13, w2, weights, ids, block_m=block_m, **options)  # type: ignore[arg-type]
