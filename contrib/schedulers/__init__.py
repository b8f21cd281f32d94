"""Alternative schedulers."""
