"""Default scheduler components."""
