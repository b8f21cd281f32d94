"""Components outside the default stack: alternatives and baselines."""
