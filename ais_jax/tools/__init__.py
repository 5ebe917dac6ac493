"""Command-line helpers that are not part of a training run (``python -m ais_jax.tools.X``)."""
