"""Kernels of the rescoring path: fused log-prob gathering, sibling top-K with profiles,
adjacent JSD boundaries. Each has a Triton kernel (CUDA), a torch/C++ CPU path and a plain
torch reference; ``impl="auto"`` picks Triton on CUDA and the CPU path elsewhere.
"""
