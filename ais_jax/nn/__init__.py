"""Numerics with no notion of a model: the FP8/FP6/FP4 matmul wrapper (`quant`), the shared
layers (`layers`) and the KV cache (`cache`). A leaf: imports nothing else of ais_jax."""
