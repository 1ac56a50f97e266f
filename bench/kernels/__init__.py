"""Entry points of the kernel benchmark (`python -m bench.kernels.gpu_kernels`); the library is engine/benchmarks/kernels/."""
