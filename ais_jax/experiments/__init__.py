"""Experiments over many runs: `compare` (arms x seeds, paired statistics)."""
