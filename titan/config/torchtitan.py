"""TorchTitan's names for recipe keys, and titan's: an unknown key that is TorchTitan's gets titan's name in its
error rather than the nearest spelling (training.dataset is nearer training.steps than data.source). Keys both
name alike (training.local_batch_size, training.seq_len, optimizer.lr, lr_scheduler.warmup_steps,
checkpoint.interval, activation_checkpoint.mode, model.name, model.flavor) need no entry."""

TORCHTITAN_KEYS = {
    "job.dump_folder": "job.output_dir (the run writes to <output_dir>/<job.name>)",
    "training.dataset": "data.source",
    "training.dataset_path": "data.source (a local file or folder, or a hub dataset)",
    "training.compile": "compile.enable",
    "training.batch_size": "training.local_batch_size (or training.global_batch_size)",
    "training.max_norm": "training.max_grad_norm",
    "training.warmup_steps": "lr_scheduler.warmup_steps",
    "training.mixed_precision_param": "training.mixed_precision",
    "training.seed": "job.seed",
    "training.deterministic": "job.deterministic",
    "training.enable_cpu_offload": "parallel.fsdp_cpu_offload",
    "model.tokenizer_path": "tokenizer.path",
    "lr_scheduler.decay_type": "lr_scheduler.decay",
    "lr_scheduler.lr_min": "lr_scheduler.min_lr_ratio",
    "lr_scheduler.decay_ratio": 'lr_scheduler.wsd_decay_ratio (with lr_scheduler.decay = "wsd")',
    "checkpoint.folder": "job.output_dir (checkpoints go to <output_dir>/<job.name>/checkpoints)",
    "checkpoint.enable_checkpoint": "checkpoint.enable",
    "checkpoint.async_mode": "checkpoint.async_save (true or false)",
    "checkpoint.initial_load_path": "checkpoint.resume",
    "parallelism.data_parallel_replicate_degree": "parallel.dp_replicate",
    "parallelism.data_parallel_shard_degree": "parallel.dp_shard",
    "parallelism.tensor_parallel_degree": "parallel.tp",
    "parallelism.pipeline_parallel_degree": "parallel.pp",
    "parallelism.context_parallel_degree": "parallel.cp",
    "parallelism.expert_parallel_degree": "parallel.ep",
    "parallelism.pipeline_parallel_schedule": "parallel.pp_schedule",
    "parallelism.pipeline_parallel_layers_per_stage": "parallel.pp_layers_per_stage",
    "parallelism.fsdp_reshard_after_forward": "parallel.fsdp_reshard_after_forward",
    "parallelism.disable_loss_parallel": "parallel.loss_parallel (its opposite)",
    "metrics.enable_wandb": 'metrics.wandb ("online", "offline", "disabled" or "auto")',
    "metrics.enable_tensorboard": "metrics.tensorboard",
    "profiling.enable_profiling": "profiling.enable",
    "profiling.enable_memory_snapshot": "profiling.memory",
    "validation.freq": "validation.interval (0 disables validation)",
    "validation.enable": "validation.interval (0 disables validation)",
    "lr_scheduler.min_lr_factor": "lr_scheduler.min_lr_ratio",
    "model.hf_assets_path": "tokenizer.path for its tokenizer.json, and checkpoint.init_from_hf for its weights",
    "model.converters": 'float8.enable = true (for "float8")',
    "activation_checkpoint.selective_ac_option": (
        'activation_checkpoint.mode = "selective" (for "op"), or mode = "full" with activation_checkpoint.every = n '
        "(for a number n)"
    ),
    "profiling.profile_freq": "profiling.active (the steps traced, after profiling.wait and profiling.warmup)",
    "comm.train_timeout_seconds": "fault.collective_timeout_s",
    "validation.dataset": "validation.source",
    "float8.recipe_name": "float8.recipe",
    "float8.filter_fqns": "float8.skip",
}

# TorchTitan's keys for what titan does without a setting, and why they can go.
TORCHTITAN_WITHOUT = {
    "job.description": "a run is named by job.name and described by its recipe",
    "job.print_config": "titan config show prints the resolved recipe",
    "metrics.disable_color_printing": "titan's log has no colours",
    "metrics.save_tb_folder": "TensorBoard writes into the run folder",
    "profiling.save_traces_folder": "traces go into the run folder",
    "profiling.save_memory_snapshot_folder": "snapshots go into the run folder",
    "parallelism.enable_async_tensor_parallel": "titan has no asynchronous tensor parallelism",
    "checkpoint.last_save_model_only": "titan convert dcp-to-hf exports the weights alone",
    "checkpoint.export_dtype": "titan convert dcp-to-hf --dtype sets it",
    "compile.components": "compile.enable compiles each transformer block",
    "comm.init_timeout_seconds": "titan's rendezvous waits as torchrun's does",
}
