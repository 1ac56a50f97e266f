"""The GPU kernel benchmark (`sloserve bench kernels`, `python -m bench.kernels.gpu_kernels`): the
Triton attention and fused kernels against what PyTorch would run instead (gpu_kernels.py), the
attention's launch-config sweep (attention_sweep.py) and their harness (harness.py)."""
