"""Benchmarks of the attention and fused kernels against PyTorch's, and the launch-config sweep."""
