"""What a run reports: metrics to the console, metrics.jsonl, TensorBoard and wandb; profiler traces."""
