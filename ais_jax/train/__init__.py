"""The trainer: the jitted phases of a GRPO step (`step`), the trainer's log-probs (`logprobs`),
the masked-diffusion estimator (`diffusion`), the data pipeline (`data`), the stateful run
(`run`, one for every family) and the job that drives it (`job`, `preemption`, `heap`)."""
