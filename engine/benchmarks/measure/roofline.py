"""This machine's limits for one model, measured in the caller's run.

Two bounds, both counted from the HF config (never hard-coded for one model):

- prefill is compute bound: the step's linear layers (2 x non-embedding linear parameters per
  token, the LM head for the sampled rows only) plus causal attention (4 x n_layers x n_heads x
  head_dim x (i + 1) FLOPs for the token at position i), each timed at the GFLOP/s that the
  faster of torch.matmul and oneDNN's prepacked linear (what the engine runs on a CPU in
  float32, workers.layers.cpu_prepack) reaches on *these* GEMM shapes, on torch's threads;
- decode is memory bound at small batches: every step reads the weights once and each request's
  K/V (2 x n_layers x n_kv_heads x head_dim x ctx x dtype bytes), at the measured read bandwidth
  of a buffer far larger than the caches (engine/benchmarks/measure/machine_limits.py read_gbps, the
  one place a device's bandwidth and matmul peak are measured). At large batches the linear
  layers' FLOPs take over, so the decode roofline is the larger of the two times; both shares
  are reported.

Nothing here is asserted on timing: `sloserve bench throughput` (engine/benchmarks/e2e/throughput.py)
prints the figures as JSON.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.benchmarks.measure.machine_limits import Timer, copy_gbps, read_gbps
from engine.simulation.profile import expected_experts_read


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the FLOP and byte counts need. A mixture of experts (``num_experts`` > 0)
    computes ``experts_per_token`` experts of ``expert_intermediate`` per token in place of the
    dense MLP (plus a shared expert where it has one), and a step reads the weights of the
    experts its tokens touch."""
    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    # Bytes of one linear-layer weight when the checkpoint stores them quantized (FP8: 1; the
    # block scales add 1/4096 and are left out); None: the compute dtype's. The LM head and the
    # KV cache stay in the compute dtype.
    linear_weight_bytes: float | None = None

    @classmethod
    def from_hf_config(cls, config) -> "ModelShape":
        n_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        experts = (getattr(config, "num_experts", None)
                   or getattr(config, "num_local_experts", None) or 0)
        return cls(hidden=config.hidden_size, intermediate=config.intermediate_size,
                   n_layers=config.num_hidden_layers, n_heads=n_heads,
                   n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
                   head_dim=head_dim, vocab=config.vocab_size, num_experts=experts,
                   experts_per_token=getattr(config, "num_experts_per_tok", 0) if experts else 0,
                   expert_intermediate=(getattr(config, "moe_intermediate_size", None)
                                        or config.intermediate_size) if experts else 0,
                   shared_expert_intermediate=getattr(
                       config, "shared_expert_intermediate_size", 0) or 0,
                   linear_weight_bytes=_quantized_weight_bytes(config))

    def attention_gemms(self) -> list[tuple[str, int, int]]:
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        h = self.hidden
        return [("q", h, q), ("k", h, kv), ("v", h, kv), ("o", q, h)]

    def layer_gemms(self) -> list[tuple[str, int, int]]:
        """(name, K, N) of each linear layer one token goes through in one decoder layer:
        x[M, K] @ W[K, N] (a mixture of experts: its experts' MLPs, each as wide as it is)."""
        h = self.hidden
        if not self.num_experts:
            i = self.intermediate
            return [*self.attention_gemms(), ("gate", h, i), ("up", h, i), ("down", i, h)]
        i = self.expert_intermediate * self.experts_per_token + self.shared_expert_intermediate
        return [*self.attention_gemms(), ("experts gate", h, i), ("experts up", h, i),
                ("experts down", i, h)]

    @property
    def linear_params(self) -> int:
        """Non-embedding linear parameters one token multiplies by (a mixture of experts: the
        active ones; norm weights and routers are negligible)."""
        return self.n_layers * sum(k * n for _, k, n in self.layer_gemms())

    @property
    def expert_params(self) -> int:
        """One expert's parameters in one layer."""
        return 3 * self.hidden * self.expert_intermediate

    def experts_touched(self, batch: int) -> float:
        """The expected distinct experts a layer runs for ``batch`` tokens routed uniformly:
        E * (1 - (1 - k/E)^batch)."""
        return expected_experts_read(self.num_experts, self.experts_per_token, batch)

    def linear_params_read(self, batch: int) -> int:
        """Linear parameters a step of ``batch`` tokens reads: every dense weight, and the
        experts its tokens touch."""
        if not self.num_experts:
            return self.linear_params
        attention = sum(k * n for _, k, n in self.attention_gemms())
        shared = 3 * self.hidden * self.shared_expert_intermediate
        return round(self.n_layers * (attention + shared
                                      + self.experts_touched(batch) * self.expert_params))

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype_bytes


def _quantized_weight_bytes(config) -> float | None:
    """1 for a checkpoint of FP8 weights (either layout), None for full-precision ones."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(
        quant, "quant_method", None)
    return 1.0 if str(method) in ("fp8", "compressed-tensors") else None


def attention_flops(shape: ModelShape, start: int, length: int) -> int:
    """Causal attention FLOPs of `length` new tokens after `start` cached ones: the token at
    position p attends to p + 1 keys, 2 FLOPs per multiply-add in QK^T and again in PV."""
    keys = length * start + length * (length + 1) // 2  # sum of (p + 1) over the new positions
    return 4 * shape.n_layers * shape.n_heads * shape.head_dim * keys


def prefill_flops(shape: ModelShape, prompt_len: int, sampled_rows: int = 1) -> dict[str, int]:
    return {"linear": 2 * shape.linear_params * prompt_len,
            "lm_head": 2 * shape.lm_head_params * sampled_rows,
            "attention": attention_flops(shape, 0, prompt_len)}


def decode_bytes_per_step(shape: ModelShape, contexts: list[int], dtype_bytes: int) -> dict[str, int]:
    """Bytes one decode step must read: the weights once (linear layers, of a mixture of experts
    those its batch touches, and the LM head; the embedding rows of a batch are negligible) and
    every request's K/V over its context."""
    linear_bytes = shape.linear_weight_bytes or dtype_bytes
    weights = round(shape.linear_params_read(len(contexts)) * linear_bytes
                    + shape.lm_head_params * dtype_bytes)
    kv = shape.kv_bytes_per_token(dtype_bytes) * sum(contexts)
    return {"weights": weights, "kv": kv, "total": weights + kv}


def decode_flops_per_step(shape: ModelShape, contexts: list[int]) -> dict[str, int]:
    batch = len(contexts)
    return {"linear": 2 * shape.linear_params * batch,
            "lm_head": 2 * shape.lm_head_params * batch,
            "attention": sum(attention_flops(shape, c - 1, 1) for c in contexts)}


def _median_seconds(fn, repeats: int) -> float:
    # One warm-up call (first-touch pages, oneDNN/MKL plan caches), then the median.
    return Timer(torch.device("cpu"), warmup=1, repeats=repeats)(fn) / 1000


def _repeats_for(flops: float) -> int:
    # Enough repeats to take a median over ~50 ms of work, never fewer than 3.
    return max(3, min(50, int(5e9 / max(flops, 1.0))))


def matmul_seconds(m: int, k: int, n: int, dtype: torch.dtype) -> float:
    """x[m, k] @ w[k, n] with the fastest kernel this machine has for it."""
    from workers.layers import cpu_prepack

    x = torch.randn(m, k).to(dtype)
    w = torch.randn(k, n).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    repeats = _repeats_for(2 * m * k * n)
    seconds = _median_seconds(lambda: torch.matmul(x, w, out=out), repeats)
    if cpu_prepack.prepack_available("cpu", dtype):
        packed = torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(),
                                                         cpu_prepack.PACK_ROWS_HINT)
        seconds = min(seconds, _median_seconds(lambda: cpu_prepack.linear(x, packed, None),
                                               repeats))
    return seconds


class Roofline:
    """Measures and caches this machine's GEMM times for one model shape and dtype."""

    def __init__(self, shape: ModelShape, dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype
        self._gemm: dict[tuple[int, int, int], float] = {}
        self._attn: dict[int, float] = {}

    def _gemm_s(self, m: int, k: int, n: int) -> float:
        if (m, k, n) not in self._gemm:
            self._gemm[(m, k, n)] = matmul_seconds(m, k, n, self.dtype)
        return self._gemm[(m, k, n)]

    def linear_seconds(self, tokens: int) -> float:
        """One step's decoder-layer GEMMs over `tokens` rows, at this machine's matmul speed."""
        s = self.shape
        return s.n_layers * sum(self._gemm_s(tokens, k, n) for _, k, n in s.layer_gemms())

    def lm_head_seconds(self, rows: int) -> float:
        return self._gemm_s(rows, self.shape.hidden, self.shape.vocab)

    def linear_gflops(self, tokens: int) -> float:
        return 2 * self.shape.linear_params * tokens / self.linear_seconds(tokens) / 1e9

    def attention_gflops(self, length: int) -> float:
        """GFLOP/s of one head's QK^T ([L, d] @ [d, L]) and PV ([L, L] @ [L, d]) GEMMs: the
        speed a well-blocked attention kernel could run the prompt's attention FLOPs at."""
        if length not in self._attn:
            d = self.shape.head_dim
            seconds = matmul_seconds(length, d, length, self.dtype) + \
                matmul_seconds(length, length, d, self.dtype)
            self._attn[length] = 4 * length * length * d / seconds / 1e9
        return self._attn[length]

    def prefill_bound(self, prompt_len: int) -> dict[str, float]:
        """Roofline tokens/s of a one-step prefill: linear layers alone, and with attention."""
        flops = prefill_flops(self.shape, prompt_len)
        linear_s = self.linear_seconds(prompt_len) + self.lm_head_seconds(1)
        attention_s = flops["attention"] / (self.attention_gflops(prompt_len) * 1e9)
        return {"linear_flops_per_token": flops["linear"] / prompt_len,
                "attention_flops_per_token": flops["attention"] / prompt_len,
                "matmul_gflops": self.linear_gflops(prompt_len),
                "attention_gflops": self.attention_gflops(prompt_len),
                "linear_roofline_s": linear_s,
                "attention_roofline_s": attention_s,
                "linear_roofline_tokens_per_s": prompt_len / linear_s,
                "full_roofline_tokens_per_s": prompt_len / (linear_s + attention_s)}

    def decode_bound(self, contexts: list[int], bandwidth_gbs: float,
                     dtype_bytes: int) -> dict[str, float]:
        """Roofline tokens/s of one decode step of len(contexts) requests: the memory time of
        its bytes, the compute time of its FLOPs, and the larger of the two."""
        batch = len(contexts)
        nbytes = decode_bytes_per_step(self.shape, contexts, dtype_bytes)
        flops = decode_flops_per_step(self.shape, contexts)
        memory_s = nbytes["total"] / (bandwidth_gbs * 1e9)
        compute_s = (self.linear_seconds(batch) + self.lm_head_seconds(batch)
                     + flops["attention"] / (self.peak_gflops() * 1e9))
        return {"bytes_per_step": nbytes["total"], "weight_bytes": nbytes["weights"],
                "kv_bytes": nbytes["kv"], "flops_per_step": sum(flops.values()),
                "bandwidth_bound_tokens_per_s": batch / memory_s,
                "compute_bound_tokens_per_s": batch / compute_s,
                "roofline_tokens_per_s": batch / max(memory_s, compute_s)}

    def peak_gflops(self) -> float:
        """The best GFLOP/s any measured GEMM of this model reached (at least one large one)."""
        if not self._gemm:
            self.linear_seconds(512)
        return max(2 * m * k * n / s / 1e9 for (m, k, n), s in self._gemm.items())


def measure_bandwidth(mib: int = 1024, repeats: int = 5) -> dict[str, float]:
    """Read (sum) and copy bandwidth of a buffer of `mib` MiB, far past the caches, measured by
    engine/benchmarks/measure/machine_limits.py. Decode mostly reads, so the read figure is the decode
    bound's bandwidth. (The copy was of a float32 buffer here before; machine_limits copies the
    same bytes as uint8, the same memcpy.)"""
    cpu = torch.device("cpu")
    timer = Timer(cpu, warmup=1, repeats=repeats)
    nbytes = mib * 2**20
    return {"bandwidth_gbs": read_gbps(cpu, timer, nbytes),
            "copy_bandwidth_gbs": copy_gbps(cpu, timer, nbytes),
            "bandwidth_buffer_mib": mib}
