"""Models that need no download: the built-in default, tiny random checkpoints, real shapes."""
