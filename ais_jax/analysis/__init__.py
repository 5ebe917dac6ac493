"""Numbers to conclusions, no JAX model code: statistics (`stats`), pass@k evaluation records
(`evaluation`) and plots (`plots`). A leaf."""
