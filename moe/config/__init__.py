"""Typed configs: build from params.yaml sections, validate, flatten for MLflow."""

from moe.config.base import Config, ConfigError, apply_overrides, parse_value, unflatten
from moe.config.experiment import ExperimentConfig, ResolvedLayout
from moe.config.model import ModelConfig, MoEConfig
from moe.config.presets import model_preset, preset_names
from moe.config.training import (
    CheckpointConfig,
    DataConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    ScheduleConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "ExperimentConfig",
    "ModelConfig",
    "MoEConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "ResolvedLayout",
    "ScheduleConfig",
    "TrainConfig",
    "apply_overrides",
    "model_preset",
    "parse_value",
    "preset_names",
    "unflatten",
]
