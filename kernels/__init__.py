"""kvscope.kernels."""
