"""The command line (`ais-jax`, `main`) and the memory planner (`plan`)."""
