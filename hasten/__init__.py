"""hasten: GRPO and RFT training that is measurably fast on the hardware you have.

`from hasten import GRPOConfig, GRPOTrainer` (and SFTConfig, SFTTrainer) is
TRL's API on hasten's loop (hasten/api/). Those names are imported on first
use, so `import hasten` and `hasten --help` stay cheap (no torch).
"""

__version__ = "0.1.0"

_API = ("GRPOConfig", "GRPOTrainer", "SFTConfig", "SFTTrainer", "TrainerState", "TrainerControl", "TrainOutput")

__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'hasten' has no attribute {name!r}")
