"""The CPU fast path: a C++ library (cpu_kernels.cpp) built at first use and called from
cpu_kernels.py; BATCHSCOPE_CPU_KERNEL=0 leaves the plain PyTorch path."""
