"""Triton GEMMs that read quantized weights (dequantized in the kernel)."""
