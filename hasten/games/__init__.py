"""Games trained with GRPO on a small tensor policy instead of a language model.

`GAMES` names them for the CLI and the trainer: `hasten train --task NAME`
dispatches a game to `hasten.train.policy_loop` rather than the language-model
loop. This module imports nothing heavy, so `hasten tasks` stays fast.
"""

GAMES: dict[str, str] = {
    "fruit-catcher": "vectorized falling-fruit game, MLP policy, G games per start state (hasten play)",
}

__all__ = ["GAMES"]
