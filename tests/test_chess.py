"""Chess: rewards on known-good and known-bad answers, the best-move heuristic on
hand-built positions, the generated rows, eval metrics, and a tiny training run."""

from __future__ import annotations

import random

import chess
import pytest

from hasten.config import TaskConfig, load_config
from hasten.rewards import score_rewards
from hasten.rewards import chess as rewards
from hasten.tasks import make_task
from hasten.tasks.chess import answer_a, answer_p, random_position
from hasten.train.trainer import train

START = chess.STARTING_FEN
AFTER_E4 = "rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1"


def levenshtein(a: str, b: str) -> int:
    """Plain dynamic programming, the oracle for rapidfuzz."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, 1):
        current = [i]
        for j, char_b in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


@pytest.mark.parametrize("fen, valid", [
    (START, True), (AFTER_E4, True),
    ("rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq", True),  # python-chess fills the clocks
    ("rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBN b KQkq - 0 1", False),  # a rank of 7 squares
    ("8/8/8/8/8/8/8/8 w - - 0 1", False),  # parses, but no kings: not a position
    ("hello", False), ("", False), (None, False),
])
def test_fen_validity(fen, valid):
    assert rewards.valid_fen(fen) is valid
    completion = [{"role": "assistant", "content": f"<fen>{fen}</fen>"}] if fen is not None else "no tags"
    assert rewards.fen_valid_reward([""], [completion]) == [float(valid)]


def test_similarity_is_one_minus_levenshtein_over_the_longer_length():
    rng = random.Random(0)
    answers, targets = [], []
    for _ in range(50):
        target = random_position(rng).fen()
        answer = list(target)
        for _ in range(rng.randint(0, 6)):  # near misses: edits, deletions, insertions
            position = rng.randrange(len(answer))
            choice = rng.random()
            if choice < 0.4:
                answer[position] = rng.choice("pnbrqk12345678/")
            elif choice < 0.7:
                del answer[position]
            else:
                answer.insert(position, rng.choice("PNBRQK"))
        answers.append("".join(answer))
        targets.append(target)
    scores = rewards.fen_similarity_reward([""] * 50, [f"<fen>{a}</fen>" for a in answers], targets)
    for score, answer, target in zip(scores, answers, targets):
        assert score == pytest.approx(1 - levenshtein(answer, target) / max(len(answer), len(target)))
    assert rewards.fen_similarity_reward(["", "", ""], [f"<fen>{AFTER_E4}</fen>", "no fen", "<fen>x</fen>"],
                                         [AFTER_E4, AFTER_E4, None]) == [1.0, 0.0, None]


def test_exact_and_flags():
    completions = [f"<fen>{AFTER_E4}</fen><flags>none</flags>", f"<fen> {AFTER_E4} </fen><flags>check</flags>",
                   f"<fen>{START}</fen><flags>capture, check</flags>", "<flags>capture check</flags>",
                   "<flags>checkmate please</flags>"]
    targets = [AFTER_E4, AFTER_E4, AFTER_E4, AFTER_E4, AFTER_E4]
    assert rewards.fen_exact_reward([""] * 5, completions, targets) == [1.0, 1.0, 0.0, 0.0, 0.0]
    flags = ["none", "none", "check capture", "capture check", "checkmate"]
    assert rewards.flags_reward([""] * 5, completions, flags) == [1.0, 0.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize("text, score", [
    (f"<fen>{AFTER_E4}</fen>\n<flags>none</flags>", 1.0),
    (f"<fen>{AFTER_E4}</fen>\n<flags>none</flags>.", 1.0),
    (f"<fen>{AFTER_E4}</fen>\n<flags>none</flags> and more words", 0.5),
    (f"<fen>{AFTER_E4}</fen>", 0.5),
    ("<fen>a</fen><fen>b</fen><flags>none</flags>", 0.5),
    ("<flags>none</flags>", 0.0),
    (AFTER_E4, 0.0),
])
def test_chess_a_format(text, score):
    assert rewards.chess_a_format_reward([""], [text]) == [score]


def test_move_legality_and_best_move():
    completions = ["<moves>e2e4 d2d4</moves><best>g1f3</best>", "<moves>e2e5 e2e4</moves><best>E2E4</best>",
                   "<moves>nonsense</moves>", "no moves at all", "<best>e2e4</best>"]
    assert rewards.move_legality_reward([""] * 5, completions, [START] * 5) == [1.0, 2 / 3, 0.0, 0.0, 1.0]
    best = [["g1f3"], ["e2e4", "d2d4"], ["e2e4"], ["e2e4"], None]
    assert rewards.best_move_reward([""] * 5, completions, best) == [1.0, 1.0, 0.0, 0.0, None]
    formats = rewards.chess_p_format_reward([""] * 5, completions)
    assert formats == [1.0, 1.0, 0.5, 0.0, 0.5]


@pytest.mark.parametrize("fen, best, kind", [
    ("rnb1kbnr/pppp1ppp/8/4p3/4P2q/5N2/PPPP1PPP/RNBQKB1R w KQkq - 2 3", ["f3h4"], "material"),  # hanging queen
    ("6k1/5ppp/8/8/8/8/8/R5K1 w - - 0 1", ["a1a8"], "mate"),  # back-rank mate
    ("6k1/5ppp/8/8/7r/8/6N1/R5K1 w - - 0 1", ["a1a8"], "mate"),  # mate beats winning the rook (g2h4)
    ("4k3/P7/8/8/8/8/8/4K3 w - - 0 1", ["a7a8q"], "material"),  # promotion to a queen (+8) tops the rest
])
def test_best_move_heuristic_on_hand_built_positions(fen, best, kind):
    found, found_kind, _ = rewards.best_moves(chess.Board(fen))
    assert (found, found_kind) == (best, kind)


def test_heuristic_sees_the_recapture():
    # Qxd5 wins a pawn but exd5 wins the queen back: -8, never best.
    board = chess.Board("4k3/8/4p3/3p4/8/8/3Q4/4K3 w - - 0 1")
    assert rewards.move_score(board, chess.Move.from_uci("d2d5")) == 1 - 9
    best, _, top = rewards.best_moves(board)
    assert "d2d5" not in best and top == 0 and not rewards.is_clear(best, "material", top)


@pytest.mark.parametrize("fen, move, flags", [
    ("6k1/5ppp/8/8/8/8/8/R5K1 w - - 0 1", "a1a8", "checkmate"),
    ("6k1/5ppp/8/8/8/8/8/R5K1 w - - 0 1", "a1a7", "none"),
    ("7k/5Q2/6K1/8/8/8/8/8 w - - 0 1", "g6h6", "stalemate"),
    ("4k3/8/8/3q4/8/8/3R4/4K3 w - - 0 1", "d2d5", "capture"),
    ("4k3/8/8/3q4/8/8/8/3RK3 w - - 0 1", "d1d5", "capture"),
    ("3qk3/8/8/8/8/8/8/3RK3 w - - 0 1", "d1d8", "capture check"),
    ("4k3/8/8/3pP3/8/8/8/4K3 w - d6 0 1", "e5d6", "capture"),  # en passant
])
def test_move_flags(fen, move, flags):
    assert rewards.move_flags(chess.Board(fen), chess.Move.from_uci(move)) == flags


@pytest.mark.parametrize("name", ["chess-a", "chess-p"])
def test_rows_are_seeded_and_right(name):
    cfg = TaskConfig(name=name, num_train=12, num_eval=6, seed=3)
    task, again = make_task(cfg), make_task(cfg)
    assert [row["question"] for row in task.train_rows] == [row["question"] for row in again.train_rows]
    example = task.train_rows[0]["prompt"][1]["content"]  # the worked example's question
    assert all(row["question"] != example for row in task.train_rows + task.eval_rows)
    for row in task.train_rows + task.eval_rows:
        board = chess.Board(row["fen"])
        if name == "chess-a":
            move = chess.Move.from_uci(row["move"])
            assert row["target_flags"] == rewards.move_flags(board, move)
            board.push(move)
            assert row["target_fen"] == board.fen()
        else:
            best, kind, top = rewards.best_moves(board)
            assert row["best_moves"] == best and rewards.is_clear(best, kind, top)


@pytest.mark.parametrize("name, answer", [("chess-a", answer_a), ("chess-p", answer_p)])
def test_perfect_answers_score_every_reward_and_metric(name, answer):
    task = make_task(TaskConfig(name=name, num_train=4, num_eval=4))
    rows = task.eval_rows
    texts = [answer(row) for row in rows]
    completions = [[{"role": "assistant", "content": text}] for text in texts]
    columns = task.columns(rows)
    scores = score_rewards(task.reward_functions, [row["prompt"] for row in rows], completions, columns,
                           [[0]] * len(rows))
    assert scores.per_function.min() == 1.0  # every reward at its best
    assert all(task.check(text, row).correct for text, row in zip(texts, rows))
    assert set(task.metrics(texts, rows).values()) == {1.0}
    assert set(task.metrics(["I do not know"] * len(rows), rows).values()) == {0.0}


@pytest.mark.parametrize("name, keys", [
    ("chess-a", ("format_rate", "fen_exact", "fen_valid_rate", "similarity_mean", "flags_accuracy")),
    ("chess-p", ("format_rate", "legal_rate", "best_move_accuracy")),
])
def test_a_tiny_chess_run_completes_and_reports_chess_metrics(tmp_path, name, keys):
    cfg = load_config(overrides=list({
        # No system prompt or worked example: the byte tokenizer makes every character a token.
        "model.name": "tiny", "task.name": name, "task.num_train": 8, "task.num_eval": 2, "train.steps": 2,
        "task.system_prompt": "", "task.worked_example": False, "eval.at_start": False,
        "train.prompts_per_step": 2, "generation.num_generations": 2, "generation.max_new_tokens": 8,
        "eval.num_examples": 2, "eval.max_new_tokens": 8, "output.dir": str(tmp_path), "output.progress": "off",
        "output.plot": False,
    }.items()))
    summary = train(cfg, log=lambda text: None)
    for key in keys:
        assert key in summary["eval_after"], key
    assert summary["eval_after"]["format_rate"] == 0.0  # 8 random bytes never close both tags
