"""Chess rewards (TRL signature) and the position knowledge they need.

Two tasks use them (tasks/chess.py):
  A  given a FEN and a UCI move, answer the resulting FEN inside <fen></fen>
     and its flags inside <flags></flags>;
  P  given a FEN, list legal moves inside <moves></moves> and name the best
     one inside <best></best>.

Every reward is deterministic and a separate function, so weights are set
per function (rewards.weights) and the runner can cache them:
  A: chess_a_format, fen_valid (python-chess accepts the board),
     fen_similarity (1 - Levenshtein / max length, rapidfuzz), fen_exact
     (the shaping bonus on top of similarity), flags (exact set match);
  P: chess_p_format, move_legality (fraction of proposed moves that are
     legal), best_move (the answer is one of the heuristic's best moves).

Flags of a move are the words that apply, in this order: "capture", then one
of "check", "checkmate", "stalemate" (a mate is not also called "check");
"none" when no word applies.

The best-move ground truth is a cheap, documented heuristic, not an engine:
  1. any move that mates at once is best (all mating moves are accepted);
  2. else each move scores material won minus the most material the
     opponent can then win with one capture (a 2-ply material count; pawn 1,
     knight and bishop 3, rook 5, queen 9; a promotion adds the new piece
     minus the pawn). The moves with the top score are all accepted.
P positions are kept only where this answer is clear (a mate, or a top
score >= 1 reached by at most 3 moves), so the label means something.

Scoring cost: parsing a FEN with python-chess takes tens of microseconds, so
a 32-sample batch scores in about a millisecond; docs/games.md has the
measurement against a step. Similarity goes through rapidfuzz's batched
`cpdist` in one call rather than a Python loop.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import chess
from rapidfuzz import process
from rapidfuzz.distance import Levenshtein

from .builtin import completion_text

PIECE_VALUES = {chess.PAWN: 1, chess.KNIGHT: 3, chess.BISHOP: 3, chess.ROOK: 5, chess.QUEEN: 9, chess.KING: 0}
FLAG_WORDS = ("capture", "check", "checkmate", "stalemate")
MAX_CLEAR_BEST = 3  # a P position is kept when at most this many moves share the top score

_TAGS = {name: re.compile(rf"<{name}>(.*?)</{name}>", re.DOTALL) for name in ("fen", "flags", "moves", "best")}


# ------------------------------------------------------------------ parsing


def tag_contents(text: str, name: str) -> list[str]:
    """Stripped contents of every <name>...</name> in `text`."""
    return [match.strip() for match in _TAGS[name].findall(text)]


def last_tag(text: str, name: str) -> str | None:
    found = tag_contents(text, name)
    return found[-1] if found else None


def parse_flags(text: str | None) -> frozenset[str] | None:
    """'capture, check' -> {'capture', 'check'}; 'none' -> {}; None when unreadable."""
    if text is None:
        return None
    words = [word for word in re.split(r"[\s,;]+", text.lower()) if word]
    if words == ["none"]:
        return frozenset()
    if not words or any(word not in FLAG_WORDS for word in words):
        return None
    return frozenset(words)


def valid_fen(text: str | None) -> bool:
    """python-chess reads the FEN and the position is legal (kings, side not to move not in check, ...)."""
    if not text:
        return False
    try:
        return chess.Board(text).is_valid()
    except ValueError:
        return False


# ------------------------------------------------------------ chess knowledge


def move_flags(board: chess.Board, move: chess.Move) -> str:
    """The flags of playing `move` on `board` (left unchanged), e.g. 'capture check' or 'none'."""
    words = ["capture"] if board.is_capture(move) else []
    board.push(move)
    try:
        if board.is_checkmate():
            words.append("checkmate")
        elif board.is_check():
            words.append("check")
        elif board.is_stalemate():
            words.append("stalemate")
    finally:
        board.pop()
    return " ".join(words) or "none"


def _material(board: chess.Board, move: chess.Move) -> int:
    """Material `move` wins at once: the captured piece plus any promotion gain."""
    gain = 0
    if board.is_en_passant(move):
        gain = PIECE_VALUES[chess.PAWN]
    else:
        captured = board.piece_type_at(move.to_square)
        gain = PIECE_VALUES[captured] if captured else 0
    if move.promotion:
        gain += PIECE_VALUES[move.promotion] - PIECE_VALUES[chess.PAWN]
    return gain


def move_score(board: chess.Board, move: chess.Move) -> int:
    """Material won by `move` minus the opponent's best single capture (or promotion) in reply."""
    gain = _material(board, move)
    board.push(move)
    try:
        replies = [_material(board, reply) for reply in board.generate_legal_captures()]
        quiet_promotions = board.generate_legal_moves(board.pawns, chess.BB_BACKRANKS & ~board.occupied)
        replies += [_material(board, reply) for reply in quiet_promotions]
    finally:
        board.pop()
    return gain - max(replies, default=0)


def best_moves(board: chess.Board) -> tuple[list[str], str, int]:
    """(best UCI moves sorted, "mate" or "material", top score); the heuristic in the module docstring."""
    mates = []
    for move in board.legal_moves:
        if not board.gives_check(move):  # cheap filter: only checking moves can mate
            continue
        board.push(move)
        if board.is_checkmate():
            mates.append(move.uci())
        board.pop()
    if mates:
        return sorted(mates), "mate", 100
    scores = {move.uci(): move_score(board, move) for move in board.legal_moves}
    if not scores:
        return [], "none", 0
    top = max(scores.values())
    return sorted(uci for uci, score in scores.items() if score == top), "material", top


def is_clear(best: list[str], kind: str, top: int) -> bool:
    """Whether a P position's label is worth training on (module docstring)."""
    return kind == "mate" or (kind == "material" and top >= 1 and len(best) <= MAX_CLEAR_BEST)


@functools.lru_cache(maxsize=4096)
def legal_uci(fen: str) -> frozenset[str]:
    """Every legal move of a position in UCI; cached because a group's G samples share one FEN."""
    return frozenset(move.uci() for move in chess.Board(fen).legal_moves)


# ------------------------------------------------------------ rewards: task A


def chess_a_format_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """1.0: exactly one <fen> and one <flags> and nothing but punctuation after the last tag;
    0.5: at least one <fen>...</fen>; 0.0 otherwise."""
    scores = []
    for completion in completions:
        text = completion_text(completion)
        fens, flags = tag_contents(text, "fen"), tag_contents(text, "flags")
        tail = text[max(text.rfind("</fen>"), text.rfind("</flags>")):].split(">", 1)[-1]
        if len(fens) == 1 and len(flags) == 1 and not any(character.isalnum() for character in tail):
            scores.append(1.0)
        else:
            scores.append(0.5 if fens else 0.0)
    return scores


def fen_valid_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the last <fen> holds a FEN python-chess accepts as a legal position, else 0.0."""
    return [1.0 if valid_fen(last_tag(completion_text(c), "fen")) else 0.0 for c in completions]


def fen_similarity_reward(prompts: list, completions: list, target_fen: list, **kwargs: Any) -> list[float | None]:
    """1 - Levenshtein(answer, target) / max(len): 0.0 without a <fen>; None for rows without a target."""
    answers = [last_tag(completion_text(c), "fen") or "" for c in completions]
    targets = [target or "" for target in target_fen]
    similarity = process.cpdist(answers, targets, scorer=Levenshtein.normalized_similarity)  # (N,) one batched call
    return [None if not target else (float(value) if answer else 0.0)
            for answer, target, value in zip(answers, targets, similarity)]


def fen_exact_reward(prompts: list, completions: list, target_fen: list, **kwargs: Any) -> list[float | None]:
    """1.0 when the last <fen> equals the target FEN exactly (after stripping), else 0.0."""
    return [None if not target else float(last_tag(completion_text(c), "fen") == target)
            for c, target in zip(completions, target_fen)]


def flags_reward(prompts: list, completions: list, target_flags: list, **kwargs: Any) -> list[float | None]:
    """1.0 when the <flags> name exactly the target's set of flags, else 0.0."""
    scores: list[float | None] = []
    for completion, target in zip(completions, target_flags):
        if target is None:
            scores.append(None)
            continue
        answer = parse_flags(last_tag(completion_text(completion), "flags"))
        scores.append(float(answer is not None and answer == parse_flags(target)))
    return scores


# ------------------------------------------------------------ rewards: task P


def proposed_moves(text: str) -> list[str]:
    """Every move the completion proposes: those in <moves>, then the <best> one."""
    listed = last_tag(text, "moves")
    moves = re.split(r"[\s,;]+", listed) if listed else []
    best = last_tag(text, "best")
    return [move for move in moves + ([best] if best else []) if move]


def chess_p_format_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """1.0: one <moves> and one <best> holding a single word; 0.5: either tag; 0.0 neither."""
    scores = []
    for completion in completions:
        text = completion_text(completion)
        moves, best = tag_contents(text, "moves"), tag_contents(text, "best")
        if len(moves) == 1 and len(best) == 1 and len(best[0].split()) == 1:
            scores.append(1.0)
        else:
            scores.append(0.5 if moves or best else 0.0)
    return scores


def move_legality_reward(prompts: list, completions: list, fen: list, **kwargs: Any) -> list[float | None]:
    """Fraction of the proposed moves (listed and best) that are legal UCI moves; 0.0 when none is proposed."""
    scores: list[float | None] = []
    for completion, position in zip(completions, fen):
        if not position:
            scores.append(None)
            continue
        moves = proposed_moves(completion_text(completion))
        legal = legal_uci(position)
        scores.append(sum(move.lower() in legal for move in moves) / len(moves) if moves else 0.0)
    return scores


def best_move_reward(prompts: list, completions: list, best_moves: list, **kwargs: Any) -> list[float | None]:
    """1.0 when <best> is one of the row's best moves (heuristic ground truth), else 0.0."""
    scores: list[float | None] = []
    for completion, accepted in zip(completions, best_moves):
        if not accepted:
            scores.append(None)
            continue
        best = last_tag(completion_text(completion), "best")
        scores.append(float(best is not None and best.lower() in accepted))
    return scores
