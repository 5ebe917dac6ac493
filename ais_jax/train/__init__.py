"""The trainer: the jitted phases of a GRPO step (`step`), the trainer's log-probs (`logprobs`),
the masked-diffusion estimator (`diffusion`), the data pipeline (`data`), the stateful run
(`run`, `diffusion_run`) and the job that drives it (`job`, `preemption`, `heap`)."""
