"""Rollout engines: the autoregressive KV-cache sampler (`sampler`) and LLaDA's masked-diffusion
sampler (`diffusion`). They import the models and `nn`, never the trainer."""
