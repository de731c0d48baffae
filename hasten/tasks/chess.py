"""Chess tasks for a language model: apply a move (chess-a) and pick a move (chess-p).

Positions come from seeded random legal games played with python-chess (no
downloads): a game of 4 to 60 random plies, restarted if it ends early, and
the position it reaches. Same task.seed, same rows.

chess-a: "Position (FEN): ... Move (UCI): e2e4" -> the FEN after the move
  inside <fen></fen> and its flags inside <flags></flags> (capture, check,
  checkmate, stalemate, or none). The move is a uniform legal move of the
  position. FENs are python-chess's `Board.fen()`: the en-passant square is
  written only when an en-passant capture is legal.
chess-p: "Position (FEN): ..." -> some legal moves inside <moves></moves> and
  the best one inside <best></best>, judged against the cheap heuristic of
  rewards/chess.py (mate in one, else a 2-ply material count). Only
  positions with a clear answer are kept, so generating rows plays more
  games than rows (about 3 per row).

With task.worked_example (the default) one solved example from a fixed seed
comes first as a prior chat turn; it is kept out of the train and eval rows.
Rewards and their default weights are in `build_chess_a` / `build_chess_p`;
rewards.weights overrides them in that order. Eval adds task metrics: format
rate, FEN exact match, FEN validity, mean similarity, flag accuracy (A) and
format rate, legal-move rate, best-move accuracy (P).
"""

from __future__ import annotations

import random
from typing import Any

import chess

from hasten.config import TaskConfig
from hasten.rewards import chess as rewards
from hasten.rewards.runner import RewardFunction
from hasten.tasks import TASKS  # the registry holds the descriptions, so listing tasks never loads python-chess
from hasten.tasks.base import Task, Verdict, chat_prompt, generate_split

MIN_PLIES, MAX_PLIES = 4, 60
EXAMPLE_SEED = 20240601  # the worked example's position; a different stream from any task.seed draw

SYSTEM_A = ("You are a chess engine. Positions are FEN strings and moves are UCI (e2e4, e7e8q). "
            "Answer with the new position inside <fen></fen> and its flags inside <flags></flags>.")
SYSTEM_P = ("You are a chess engine. Positions are FEN strings and moves are UCI (e2e4, e7e8q). "
            "List a few legal moves inside <moves></moves>, then the best move inside <best></best>.")


def random_position(rng: random.Random) -> chess.Board:
    """A position reached by random legal moves, with at least one legal move left."""
    while True:
        board = chess.Board()
        for _ in range(rng.randint(MIN_PLIES, MAX_PLIES)):
            moves = list(board.legal_moves)  # python-chess generates in a fixed order: seeded draws repeat
            if not moves:
                break
            board.push(rng.choice(moves))
        if not board.is_game_over():
            return chess.Board(board.fen())  # drop the move stack: the FEN is the whole input


def _side(board: chess.Board) -> str:
    return "White" if board.turn == chess.WHITE else "Black"


# ------------------------------------------------------------------ chess-a


def sample_a(rng: random.Random) -> dict[str, Any]:
    board = random_position(rng)
    move = rng.choice(list(board.legal_moves))
    flags = rewards.move_flags(board, move)
    fen = board.fen()
    board.push(move)
    question = f"Position (FEN): {fen}\nMove (UCI): {move.uci()}\nWhat is the position after the move?"
    return {"question": question, "fen": fen, "move": move.uci(), "target_fen": board.fen(),
            "target_flags": flags}


def answer_a(row: dict[str, Any]) -> str:
    return f"<fen>{row['target_fen']}</fen>\n<flags>{row['target_flags']}</flags>"


def check_a(text: str, row: dict[str, Any]) -> Verdict:
    """parsed: a <fen> is given; correct: the FEN and the flags are both exact."""
    answer = rewards.last_tag(text, "fen")
    flags = rewards.parse_flags(rewards.last_tag(text, "flags"))
    correct = answer == row["target_fen"] and flags == rewards.parse_flags(row["target_flags"])
    return Verdict(parsed=answer is not None, correct=bool(correct))


def metrics_a(texts: list[str], rows: list[dict[str, Any]]) -> dict[str, float]:
    """format_rate, fen_exact, fen_valid_rate, similarity_mean, flags_accuracy over held-out completions."""
    if not rows:
        return {}
    prompts = [row["prompt"] for row in rows]
    targets, flags = [row["target_fen"] for row in rows], [row["target_flags"] for row in rows]
    count = len(rows)
    return {
        "format_rate": sum(s == 1.0 for s in rewards.chess_a_format_reward(prompts, texts)) / count,
        "fen_exact": sum(rewards.fen_exact_reward(prompts, texts, targets)) / count,
        "fen_valid_rate": sum(rewards.fen_valid_reward(prompts, texts)) / count,
        "similarity_mean": sum(rewards.fen_similarity_reward(prompts, texts, targets)) / count,
        "flags_accuracy": sum(rewards.flags_reward(prompts, texts, flags)) / count,
    }


def build_chess_a(cfg: TaskConfig) -> Task:
    system = cfg.system_prompt if cfg.system_prompt is not None else SYSTEM_A
    example = sample_a(random.Random(EXAMPLE_SEED))
    examples = ((example["question"], answer_a(example)),) if cfg.worked_example else ()

    def sample(rng: random.Random) -> dict[str, Any]:
        row = sample_a(rng)
        return {"prompt": chat_prompt(row["question"], system, examples), **row}

    train_rows, eval_rows = generate_split(sample, cfg.num_train, cfg.num_eval, cfg.seed,
                                           exclude=[example["question"]])
    return Task(
        name="chess-a", description=TASKS["chess-a"][1], train_rows=train_rows, eval_rows=eval_rows,
        reward_functions=[
            RewardFunction("format", rewards.chess_a_format_reward, weight=0.25, deterministic=True),
            RewardFunction("fen_valid", rewards.fen_valid_reward, weight=0.25, deterministic=True),
            RewardFunction("similarity", rewards.fen_similarity_reward, weight=1.0, deterministic=True),
            RewardFunction("exact", rewards.fen_exact_reward, weight=0.5, deterministic=True),
            RewardFunction("flags", rewards.flags_reward, weight=0.25, deterministic=True),
        ],
        check=check_a,
        metrics=metrics_a,
    )


# ------------------------------------------------------------------ chess-p


def sample_p(rng: random.Random) -> dict[str, Any]:
    while True:
        board = random_position(rng)
        best, kind, top = rewards.best_moves(board)
        if rewards.is_clear(best, kind, top):
            break
    fen = board.fen()
    question = f"Position (FEN): {fen}\n{_side(board)} to move. Which move is best?"
    return {"question": question, "fen": fen, "best_moves": best, "best_kind": kind}


def answer_p(row: dict[str, Any]) -> str:
    board = chess.Board(row["fen"])
    others = sorted(move.uci() for move in board.legal_moves if move.uci() not in row["best_moves"])[:2]
    return f"<moves>{' '.join(others + row['best_moves'][:1])}</moves>\n<best>{row['best_moves'][0]}</best>"


def check_p(text: str, row: dict[str, Any]) -> Verdict:
    """parsed: a <best> is given; correct: it is one of the heuristic's best moves."""
    best = rewards.last_tag(text, "best")
    return Verdict(parsed=best is not None, correct=best is not None and best.lower() in row["best_moves"])


def metrics_p(texts: list[str], rows: list[dict[str, Any]]) -> dict[str, float]:
    """format_rate, legal_rate (mean fraction of legal proposed moves), best_move_accuracy."""
    if not rows:
        return {}
    prompts = [row["prompt"] for row in rows]
    count = len(rows)
    return {
        "format_rate": sum(s == 1.0 for s in rewards.chess_p_format_reward(prompts, texts)) / count,
        "legal_rate": sum(rewards.move_legality_reward(prompts, texts, [row["fen"] for row in rows])) / count,
        "best_move_accuracy": sum(rewards.best_move_reward(prompts, texts, [row["best_moves"] for row in rows]))
        / count,
    }


def build_chess_p(cfg: TaskConfig) -> Task:
    system = cfg.system_prompt if cfg.system_prompt is not None else SYSTEM_P
    example = sample_p(random.Random(EXAMPLE_SEED))
    examples = ((example["question"], answer_p(example)),) if cfg.worked_example else ()

    def sample(rng: random.Random) -> dict[str, Any]:
        row = sample_p(rng)
        return {"prompt": chat_prompt(row["question"], system, examples), **row}

    train_rows, eval_rows = generate_split(sample, cfg.num_train, cfg.num_eval, cfg.seed,
                                           exclude=[example["question"]])
    return Task(
        name="chess-p", description=TASKS["chess-p"][1], train_rows=train_rows, eval_rows=eval_rows,
        reward_functions=[
            RewardFunction("format", rewards.chess_p_format_reward, weight=0.25, deterministic=True),
            RewardFunction("legal", rewards.move_legality_reward, weight=0.5, deterministic=True),
            RewardFunction("best", rewards.best_move_reward, weight=1.0, deterministic=True),
        ],
        check=check_p,
        metrics=metrics_p,
    )


__all__ = ["build_chess_a", "build_chess_p"]
