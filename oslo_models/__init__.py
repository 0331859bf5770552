"""oslo-models: Hugging Face compatible models with parallelism built in."""
