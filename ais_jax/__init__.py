"""ais_jax (package initialising)."""
