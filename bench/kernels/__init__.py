"""The GPU kernel benchmark (`python -m bench.kernels.gpu_kernels`): the Triton attention and
fused kernels against what PyTorch would run instead (gpu_kernels.py, its flags in args.py), the
attention's launch-config sweep (attention_sweep.py, `--sweep-configs`) and their harness
(harness.py)."""
