"""The CPU fast path: a C++ library (cpu_kernels.cpp) built at first use, loaded by cpu_kernels.py and
called through the checked ops of ops.py; BATCHSCOPE_CPU_KERNEL=0 leaves the plain PyTorch path."""
