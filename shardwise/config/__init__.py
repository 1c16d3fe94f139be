"""Configuration: one dataclass per component, TOML loading, CLI overrides, validation."""

from shardwise.config.loader import add_config_arguments, config_from_args, load_config
from shardwise.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)
from shardwise.core.model import ModelConfig

__all__ = [
    "CheckpointConfig", "Config", "DataConfig", "ModelConfig", "ParallelConfig", "RunConfig", "TrainConfig",
    "add_config_arguments", "config_from_args", "load_config",
]
