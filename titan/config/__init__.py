"""The recipe schema: typed dataclasses, loaded from TOML plus dotted CLI overrides, validated once.

Every user mistake raises `ConfigError` with a one-line message that names the key; the CLI prints it
and exits with status 2. Nothing else in titan parses recipe text.

sections.py holds the sections, load.py reads and writes recipes, checks.py validates them, layout.py splits the world
by the parallel degrees, stages.py resolves the data stages' steps and resume_keys.py names the keys a resume checks.
"""

from __future__ import annotations

from titan.config.checks import MAY_BE_INFINITE, NO_DATA, NO_TOKENIZER, require_inputs, validate
from titan.config.layout import LAYOUT_SPEC, Layout, LayoutError, degrees_world_size
from titan.config.load import (
    DEGREES,
    ELSEWHERE,
    _all_keys,
    load_config,
    parse_overrides,
    read_config,
    saved_section,
    to_toml,
    toml_value,
)
from titan.config.resume_keys import MATH_KEYS, PREPARED_KEYS, math_values
from titan.config.sections import (
    ActivationCheckpoint,
    Checkpoint,
    Compile,
    Config,
    Data,
    DataSource,
    DataStage,
    Eval,
    Float8,
    Job,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallel,
    PlanTarget,
    Profiling,
    Replay,
    Straggler,
    Tokenizer,
    Training,
    Validation,
    ValidationSet,
    to_dict,
)
from titan.config.stages import (
    BLEND_PERIOD,
    MAX_BLEND_PERIOD,
    Stage,
    blend_period,
    decay_start,
    describe_stages,
    run_stages,
    stage_at,
)
from titan.errors import require

__all__ = [
    "BLEND_PERIOD",
    "DEGREES",
    "ELSEWHERE",
    "LAYOUT_SPEC",
    "MATH_KEYS",
    "MAX_BLEND_PERIOD",
    "MAY_BE_INFINITE",
    "NO_DATA",
    "NO_TOKENIZER",
    "PREPARED_KEYS",
    "ActivationCheckpoint",
    "Checkpoint",
    "Compile",
    "Config",
    "Data",
    "DataSource",
    "DataStage",
    "Eval",
    "Float8",
    "Job",
    "LRScheduler",
    "Layout",
    "LayoutError",
    "Metrics",
    "Model",
    "Optimizer",
    "Parallel",
    "PlanTarget",
    "Profiling",
    "Replay",
    "Stage",
    "Straggler",
    "Tokenizer",
    "Training",
    "Validation",
    "ValidationSet",
    "_all_keys",  # tests check that config_keys lists every key
    "blend_period",
    "decay_start",
    "degrees_world_size",
    "describe_stages",
    "load_config",
    "math_values",
    "parse_overrides",
    "read_config",
    "require",
    "require_inputs",
    "run_stages",
    "saved_section",
    "stage_at",
    "to_dict",
    "to_toml",
    "toml_value",
    "validate",
]
