"""Proposers outside the default stack (for measuring, not for serving)."""
