"""Default executor components."""
