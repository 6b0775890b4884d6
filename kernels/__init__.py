"""Attention kernels: a plain-torch reference, the CPU torch path and Triton kernels."""
