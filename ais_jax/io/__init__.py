"""Files in and out: Hugging Face and GGUF checkpoints (`hf`, `gguf_file`), training checkpoints
(`checkpoint`), the run log (`run_log`), safe paths (`paths`) and provenance."""
