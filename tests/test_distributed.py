"""Data parallel (train/distributed.py): the batch split, the errors, and 2 gloo ranks against 1 process.

The equivalence test launches real torchrun processes on the CPU (gloo) with
the tiny model: same global batch and seed, the same losses and weights as
one process within 1e-5 after several steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import encode

from hasten.cli import main
from hasten.config import ConfigError, load_config
from hasten.rollout import KVCacheEngine, RowRange, SamplingParams
from hasten.rollout.lean import LeanEngine
from hasten.train import distributed

ROOT = Path(__file__).resolve().parent.parent

LETTERS = '''
def letters(prompts, completions, **kwargs):
    return [sum(c.islower() for c in text) / max(len(text), 1) for text in completions]
'''


@pytest.mark.parametrize("engine_class", [KVCacheEngine, LeanEngine])
def test_slices_of_a_seeded_batch_sample_what_the_whole_batch_samples(short_model, tokenizer, engine_class):
    engine = engine_class(short_model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    prompts = encode(tokenizer, ["hello there", "hi", "a much longer prompt, with punctuation!", "four"])
    sampling, group = SamplingParams(10, temperature=1.0), 3
    whole = engine.generate(prompts, group, sampling, seed=7)
    first = engine.generate(prompts[:2], group, sampling, seed=7, rows=RowRange(0, 12))
    second = engine.generate(prompts[2:], group, sampling, seed=7, rows=RowRange(6, 12))
    assert first.completion_token_lists() + second.completion_token_lists() == whole.completion_token_lists()
    assert torch.equal(torch.cat([first.ended_with_eos, second.ended_with_eos]), whole.ended_with_eos)
    # A slice is not the same as a batch of its own: another seed's draws would give other tokens.
    alone = engine.generate(prompts[2:], group, sampling, seed=7)
    assert alone.completion_token_lists() != second.completion_token_lists()


def test_without_torchrun_every_helper_is_the_identity(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tensor = torch.arange(6.0)
    assert distributed.world_size() == 1 and distributed.rank() == 0 and distributed.is_main()
    assert distributed.gather_rows(tensor) is tensor
    assert distributed.sum_over_ranks(2.5) == 2.5
    assert distributed.group_slice(4) == slice(0, 4)
    assert distributed.from_main(lambda: "x") == "x"
    assert distributed.agree_signal(None) is None


def test_config_that_does_not_split_over_ranks_is_one_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="prompts_per_step=3 groups do not split"):
        distributed.check_config(load_config(overrides=[("train.prompts_per_step", 3)]))
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        distributed.check_config(load_config(overrides=[("algo.dynamic_sampling", True)]))
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        distributed.check_config(load_config(overrides=[("train.prompts_per_step", 2),
                                                        ("generation.num_generations", 2),
                                                        ("train.gradient_accumulation_steps", 3)]))
    code = main(["train", "--model", "tiny", "--task", "arithmetic", "--train.prompts_per_step=3",
                 f"--output.dir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "do not split into whole groups over 2 ranks" in err[0]
    assert not any(tmp_path.iterdir())


def launch_args(tmp_path: Path, name: str, extra: list[str]) -> list[str]:
    """`hasten train` arguments on the tiny model (a letters reward on a jsonl task), writing runs/NAME."""
    data = tmp_path / "data.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"prompt": f"write letters {i}:"}) + "\n" for i in range(40)))
        (tmp_path / "rewards.py").write_text(LETTERS)
    return ["train", "--model", "tiny", "--task", "jsonl", f"--task.path={data}",
            "--reward", f"{tmp_path / 'rewards.py'}:letters", "--train.prompts_per_step=4",
            "--generation.num_generations=4", "--generation.max_new_tokens=10", "--train.lr=3e-3",
            "--eval.num_examples=4", "--eval.max_new_tokens=6", "--train.num_threads=1",
            f"--output.dir={tmp_path / 'runs'}", f"--output.name={name}", "--output.progress=off",
            "--output.plot=false", *extra]


def launch(tmp_path: Path, name: str, ranks: int, extra: list[str]) -> Path:
    """`hasten train` on the tiny model, in 1 process or under torchrun with `ranks` gloo ranks."""
    hasten(ranks, launch_args(tmp_path, name, extra))
    return tmp_path / "runs" / name


def child_env() -> dict[str, str]:
    """This worktree's hasten and the tests' helpers first on the path, one thread per rank, no inherited rank."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                                       os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    return env


def hasten(ranks: int, args: list[str]) -> None:
    """`hasten ARGS` in one process, or under torchrun with `ranks` gloo ranks; it must succeed."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
                if ranks > 1 else [sys.executable])
    done = subprocess.run([*launcher, "-m", "hasten.cli", *args], capture_output=True, text=True, env=child_env(),
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]


def weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run / "checkpoint" / "model.safetensors"))


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("options", [
    ["--train.steps=4", "--algo.loss=dapo"],
    ["--train.steps=3", "--algo.loss=grpo", "--algo.beta=0.05", "--algo.num_iterations=2",
     "--algo.scale_rewards=batch", "--speed.engine=hf", "--train.gradient_accumulation_steps=2",
     "--train.lr=1e-3"],  # 6 AdamW steps: at 3e-3 its normalised update turns 1e-7 gradient rounding into 1.5e-5
], ids=["dapo", "grpo-kl-mu2-batchscale-hf-accum"])
def test_two_gloo_ranks_learn_what_one_process_learns(tmp_path, options):
    one = launch(tmp_path, "one", 1, options)
    two = launch(tmp_path, "two", 2, options)
    single, double = records(one), records(two)
    assert len(single) == len(double) >= 3
    for a, b in zip(single, double):
        for key in ("loss", "reward_mean", "reward_std", "completion_length", "entropy", "grad_norm"):
            assert a[key] == pytest.approx(b[key], abs=1e-5, rel=1e-5), (a["step"], key)
    before, after = weights(one), weights(two)
    assert max(float((before[k] - after[k]).abs().max()) for k in before) < 1e-5
    assert all(record["grad_norm"] > 0 for record in single)  # there was something to learn
    # rank 0 alone wrote the run: one config, one summary, its eval
    summary = json.loads((two / "summary.json").read_text())
    assert summary["status"] == "finished" and "eval_after" in summary
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())


def test_a_two_rank_run_resumes_on_two_ranks_where_it_left_off(tmp_path):
    run = launch(tmp_path, "two", 2, ["--train.steps=4", "--output.save_every=2", "--output.save_total_limit=0"])
    straight_weights, straight_records = weights(run), records(run)
    hasten(2, ["train", "--resume", str(run / "checkpoint-2")])  # every rank restores checkpoint-2
    resumed = records(run)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight_records, resumed):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["reward_mean"] == b["reward_mean"]
    after = weights(run)
    assert max(float((straight_weights[k] - after[k]).abs().max()) for k in after) < 1e-6


def test_sft_on_two_gloo_ranks_matches_one_process(tmp_path):
    from safetensors.torch import load_file

    from hasten.rft.data import RFTRecord, write_records
    from hasten.rft.profiles import load_rft_config
    from hasten.tasks import make_task

    task = make_task(load_rft_config("sft", None, [("task.num_train", 8)]).task)
    data = write_records(tmp_path / "rft.json", [RFTRecord(r["question"], r["answer"], f"<answer>{r['answer']:g}"
                                                           "</answer>") for r in task.train_rows])
    runs = {}
    for ranks in (1, 2):
        hasten(ranks, ["sft", "--model", "tiny", "--data", str(data), "--task.num_train=8", "--sft.epochs=2",
                       "--sft.batch_size=4", "--sft.gradient_accumulation_steps=2", "--sft.lr=1e-3",
                       "--eval.num_examples=0", "--train.num_threads=1", f"--output.dir={tmp_path / 'runs'}",
                       f"--output.name=sft-{ranks}", "--output.progress=off", "--output.plot=false"])
        runs[ranks] = tmp_path / "runs" / f"sft-{ranks}"
    single, double = records(runs[1]), records(runs[2])
    assert len(single) == len(double) == 4
    for a, b in zip(single, double):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5) and a["tokens"] == b["tokens"]
    (weights_file,) = (runs[1] / "checkpoint").glob("*.safetensors")
    before, after = load_file(str(weights_file)), load_file(str(runs[2] / "checkpoint" / weights_file.name))
    assert max(float((before[k] - after[k]).abs().max()) for k in before) < 1e-5


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_torchrun_nodes_on_localhost_learn_what_one_process_learns(tmp_path):
    """README's multi-node command, run as two "nodes" (one process each) meeting at a c10d rendezvous."""
    one = launch(tmp_path, "one", 1, ["--train.steps=3", "--algo.loss=dapo"])
    name, port = "nodes", free_port()
    args = launch_args(tmp_path, name, ["--train.steps=3", "--algo.loss=dapo"])
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hasten-nodes",
            "-m", "hasten.cli", *args]
    nodes = [subprocess.Popen(node, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env())
             for _ in range(2)]
    outputs = [process.communicate(timeout=240)[0] for process in nodes]
    assert [process.returncode for process in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    two = tmp_path / "runs" / name
    single, double = records(one), records(two)
    assert len(single) == len(double) == 3
    for a, b in zip(single, double):
        for key in ("loss", "reward_mean", "completion_length", "grad_norm"):
            assert a[key] == pytest.approx(b[key], abs=1e-5, rel=1e-5), (a["step"], key)
    before, after = weights(one), weights(two)
    assert max(float((before[k] - after[k]).abs().max()) for k in before) < 1e-5
    # --nnodes 2 holds each node at the rendezvous until the other arrives: the run had 2 ranks
