"""Adapters that put ais_jax's correction and rollout engine inside other RL libraries.

Each module imports its library at the top and is imported only on request
(``from ais_jax.integrations import tunix``), so ais_jax itself never needs them.
"""
