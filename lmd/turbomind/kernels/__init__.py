"""Triton kernels, each beside the PyTorch reference of the same op (the CPU path and the test oracle)."""
