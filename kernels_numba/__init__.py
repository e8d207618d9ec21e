"""The math: CPU (numba njit) and CUDA (numba.cuda) kernels, each with a numpy oracle."""
