"""hasten as a library, with TRL's API: GRPOConfig / GRPOTrainer, SFTConfig / SFTTrainer.

A TRL script switches by changing its import line; everything then runs on
hasten's own loop (train/loop.py), config (config.py: the run's config.yaml
is the resolved GRPOConfig) and engines. docs/trl.md lists every TRL field:
supported, different, or not supported and why.
"""

from .callbacks import TrainerControl, TrainerState
from .grpo_config import APIError, GRPOConfig
from .grpo_trainer import GRPOTrainer
from .runs import TrainOutput
from .sft import SFTConfig, SFTTrainer

__all__ = ["APIError", "GRPOConfig", "GRPOTrainer", "SFTConfig", "SFTTrainer", "TrainOutput", "TrainerControl",
           "TrainerState"]
