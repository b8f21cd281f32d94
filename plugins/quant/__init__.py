"""Default quant components."""
