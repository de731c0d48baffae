"""Pinned numbers: a few GRPO steps on the tiny model must give the losses, log-probs and weights recorded
in tests/data/pinned_tiny.json.

The file was written before the issue-29 restructure (`python tests/test_pinned.py --write`) and the
restructure was checked against it bit for bit on the machine that wrote it. The test compares within
1e-6 (relative) so that another CPU's kernels, which may round differently, do not fail it; a change to
what is computed moves these numbers far more than that. One thread, so the order of reductions is fixed.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

PINNED = Path(__file__).parent / "data" / "pinned_tiny.json"
REWARD = '''
def letters(prompts, completions, **kwargs):
    return [sum(c.islower() for c in text) / max(len(text), 1) for text in completions]
'''
KEYS = ("loss", "grad_norm", "reward_mean", "completion_length", "entropy")


def run(directory: Path, profile: str | None) -> dict:
    from hasten.config import load_config
    from hasten.train.trainer import train

    rows = [{"prompt": f"write letters {i}:"} for i in range(24)]
    (directory / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (directory / "rewards.py").write_text(REWARD)
    pairs = {
        "model.name": "tiny", "task.name": "jsonl", "task.path": str(directory / "data.jsonl"),
        "rewards.extra": [f"{directory / 'rewards.py'}:letters"], "train.steps": 3, "train.prompts_per_step": 2,
        "train.lr": 3e-3, "train.num_threads": 1, "generation.num_generations": 4, "generation.max_new_tokens": 10,
        "eval.num_examples": 0, "output.dir": str(directory / "runs"), "output.progress": "off",
        "output.plot": False, "algo.beta": 0.04,
    }
    cfg = load_config(overrides=list(pairs.items()), profile=profile)
    summary = train(cfg, log=lambda text: None)
    run_dir = Path(summary["run_dir"])
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    from safetensors.torch import load_file

    weights = load_file(next(run_dir.glob("checkpoint/model.safetensors")))
    digest = hashlib.sha256(b"".join(weights[name].numpy().tobytes() for name in sorted(weights))).hexdigest()
    return {"steps": [{key: row[key] for key in KEYS if key in row} for row in steps], "weights_sha256": digest,
            "weights_sum": float(sum(tensor.double().sum() for tensor in weights.values()))}


PROFILES = ["baseline", "conservative"]


@pytest.mark.parametrize("profile", PROFILES)
def test_tiny_run_matches_the_pinned_numbers(tmp_path, profile):
    expected = json.loads(PINNED.read_text())[profile]
    got = run(tmp_path, profile)
    assert len(got["steps"]) == len(expected["steps"])
    for step, (have, want) in enumerate(zip(got["steps"], expected["steps"]), start=1):
        assert have.keys() == want.keys(), step
        for key in want:
            assert math.isclose(have[key], want[key], rel_tol=1e-6, abs_tol=1e-9), (step, key, have[key], want[key])
    # 1e-6 as above: an Intel Xeon with AMX ends 2e-8..4e-8 (relative) off the AMD EPYC that wrote the file;
    # one Adam step more or less, or another lr, moves the sum by far more (each weight moves ~lr)
    assert math.isclose(got["weights_sum"], expected["weights_sum"], rel_tol=1e-6)


if __name__ == "__main__" and "--write" in sys.argv:  # regenerate (only when a change means to move them)
    import tempfile

    torch.set_num_threads(1)
    out = {}
    for profile in PROFILES:
        with tempfile.TemporaryDirectory() as scratch:
            out[profile] = run(Path(scratch), profile)
    PINNED.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
