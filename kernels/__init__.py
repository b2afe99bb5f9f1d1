"""Triton kernels of tiered-radix, imported as ``tiered_radix.kernels``."""
