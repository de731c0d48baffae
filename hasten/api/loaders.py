"""TRL's get_train_dataloader / get_eval_dataloader over the rows hasten's loop draws.

hasten's loop reads prompts through its own feeder (train/feeder.py), not a
DataLoader; these loaders exist for scripts that inspect or iterate what
TRL's trainer would feed. The train loader yields, per generation batch, the
rows the loop draws for that step (the same seeded sampler: tasks/sampler.py),
each prompt num_generations times in a row, as TRL's RepeatSampler lays them
out; the eval loader yields the eval rows, each num_generations_eval times.
A curriculum (algo.curriculum) draws by rewards, so its order is not known
ahead: asking for the loader then is an error, not a guess.
"""

from __future__ import annotations

from typing import Any

from ..config import Config
from .grpo_config import APIError


def same(items: Any) -> Any:
    """The collate function: rows stay a list of dicts, as TRL's identity collator leaves them."""
    return items


def train_dataloader(cfg: Config, rows: list[dict], num_workers: int):
    """One item per hasten step: prompts_per_step rows drawn as the loop draws them, each num_generations
    times (a list of prompts_per_step x num_generations dicts)."""
    from torch.utils.data import DataLoader

    from ..tasks.sampler import PromptSampler

    if cfg.algo.curriculum != "off":
        raise APIError(f"get_train_dataloader: algo.curriculum={cfg.algo.curriculum} draws prompts by their "
                       "rewards, so the order is only known while training")
    sampler = PromptSampler(rows, cfg.train.seed, cfg.train.shuffle)  # the loop's seed and shuffle
    group = cfg.generation.num_generations
    batches = [[row for row in sampler.next(cfg.train.prompts_per_step) for _ in range(group)]
               for _ in range(cfg.train.steps)]
    return DataLoader(batches, batch_size=None, num_workers=num_workers, collate_fn=same)


def eval_dataloader(rows: list[dict], num_generations: int, batch_size: int, num_workers: int):
    """The eval rows in order, each num_generations times, per_device_eval_batch_size samples a batch."""
    from torch.utils.data import DataLoader

    repeated = [row for row in rows for _ in range(num_generations)]
    return DataLoader(repeated, batch_size=batch_size, num_workers=num_workers, collate_fn=same)
