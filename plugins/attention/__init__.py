"""Default attention components."""
