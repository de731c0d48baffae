"""`hasten bench`'s output contract, not its numbers.

Benchmarks are not tests: nothing here asserts a timing, a ratio's size or
even that a time is positive. One `--quick` smoke run on the tiny model checks
the table's and the JSON line's shape: every workload and row is there, and
the reported medians and ratios are the ones the raw seconds give. The
startup (B4) and TRL peer runs start extra processes and are benchmarks in
all but name: they run only with HASTEN_SLOW=1 (TRL also needs `hasten[bench]`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import time

import pytest

from hasten.bench import main
from hasten.bench.report import Result, Row, mfu, pair_ratio, to_json

slow = pytest.mark.skipif(not os.environ.get("HASTEN_SLOW"), reason="a benchmark run in extra processes; HASTEN_SLOW=1")
ROW_KEYS = {"name", "side", "unit", "median", "min", "max", "seconds", "mfu", "limit", "phase_limits"}


def run_bench(capsys, *argv: str) -> tuple[str, dict]:
    code = main(["--quick", *argv])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.strip().splitlines()
    return "\n".join(lines[:-1]), json.loads(lines[-1])  # the JSON line comes last


def rows_of(payload: dict, workload: str) -> dict[str, dict]:
    """The workload's rows by name, each checked to report what its own seconds give."""
    rows = {row["name"]: row for row in payload["workloads"][workload]["rows"]}
    for row in rows.values():
        assert ROW_KEYS <= row.keys(), row.keys()
        values = [w / s for w, s in zip(row["work"], row["seconds"])] if row["unit"] == "tok/s" else row["seconds"]
        assert row["seconds"] and row["median"] == pytest.approx(statistics.median(values))
        assert (row["min"], row["max"]) == (pytest.approx(min(values)), pytest.approx(max(values)))
        if row["side"] == "peer" and row["baseline"] is None:  # no hasten row to compare with
            assert row["ratio"] is None
        elif row["side"] == "peer":
            base = rows[row["baseline"]]
            pairs = [p / h for p, h in zip(row["seconds"], base["seconds"])]
            assert row["ratio"] == pytest.approx(statistics.median(pairs))
    return rows


def test_quick_b1_b2_b3_table_and_json_shape(capsys):
    table, payload = run_bench(capsys, "--workloads", "B1,B2,B3", "--peers", "hf")
    assert {"model", "cpus", "torch_threads", "peak_gflops", "workloads"} <= payload.keys()
    assert payload["model"] == "tiny" and payload["quick"] is True
    assert list(payload["workloads"]) == ["B1", "B2", "B3"]  # in the order asked for

    hasten = rows_of(payload, "B1")["hasten"]
    assert hasten["unit"] == "s/step" and {"generate", "learn", "first_step", "reward_mean"} <= hasten.keys()
    assert isinstance(hasten["page_faults"], int) and hasten["page_faults"] >= 0
    # hasten's side runs in the bench process: its peak so far, at most the process's peak at the end
    assert 0 < hasten["peak_rss_mib"] <= payload["peak_rss_mib"] + 1
    assert 0 <= hasten["reward_mean"] <= 1.25  # format 0.25 + correct 1.0
    assert payload["workloads"]["B1"]["settings"]["hasten"]["task"]["worked_example"] is False

    decode = rows_of(payload, "B2")
    assert {"kv-cache", "hf generate"} <= decode.keys()
    assert all(row["work"] == [2 * 4 * 8] * 2 for row in decode.values())  # EOS never ends a row
    assert decode["hf generate"]["baseline"] == "kv-cache"
    assert payload["workloads"]["B2"]["ratios"]["hf generate/kv-cache"] == decode["hf generate"]["ratio"]

    learning = rows_of(payload, "B3")
    assert set(learning) == {"packed", "padded"}

    # The table: its header, then one line per row, workload first.
    assert "engine/peer" in table and "settings" in table
    lines = table.splitlines()
    for workload in ("B1", "B2", "B3"):
        for name in rows_of(payload, workload):
            assert any(line.split()[:1] == [workload] and name in line for line in lines), (workload, name)


def test_quick_b2_speculative_rows_and_batch_sweep(capsys):
    _, payload = run_bench(capsys, "--workloads", "B2", "--peers", "none", "--speculative", "ngram,layers:1",
                           "--speculative-tokens", "3", "--batch-sizes", "1,4")
    decode = rows_of(payload, "B2")
    assert {"lean", "lean+ngram", "lean+draft(layers:1)"} <= decode.keys()
    assert all(row["work"] == [2 * 4 * 8] * 2 for row in decode.values())  # EOS ignored, speculative too
    assert 0 <= decode["lean+ngram"]["spec/acceptance"] <= 1 and decode["lean+ngram"]["spec/tokens_per_forward"] >= 1
    sweep = rows_of(payload, "B2-batch")
    for mode in ("sampled", "greedy"):
        for batch in (1, 4):
            names = [f"{mode} b={batch} {engine}" for engine in ("lean", "lean+ngram", "lean+draft(layers:1)")]
            assert set(names) <= sweep.keys()
            if mode == "sampled":
                assert all(sweep[name]["work"] == [batch * 8] * 2 for name in names)
            else:  # greedy: the same tokens from every engine, so the same count (EOS may end rows)
                assert len({tuple(sweep[name]["work"]) for name in names}) == 1


@pytest.mark.parametrize("json_only, lines", [(True, 1), (False, None)])
def test_json_only_prints_the_json_line_alone(capsys, monkeypatch, json_only, lines):
    import hasten.bench.command

    result = Result("B3", "learning", [Row("packed", "hasten", "s", [1.0, 2.0])])
    monkeypatch.setattr(hasten.bench.command, "run", lambda opts: ([result], {"model": "tiny"}, 1.0))
    assert main(["--quick", "--workloads", "B3"] + (["--json-only"] if json_only else [])) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1])["workloads"]["B3"]["rows"][0]["median"] == 1.5
    assert len(out) == 1 if json_only else len(out) > 5 and "engine/peer" in "\n".join(out)


@slow
def test_b4_startup_rows(capsys):
    _, payload = run_bench(capsys, "--workloads", "B4", "--peers", "none")
    rows = rows_of(payload, "B4")
    assert {"hasten --help", "hasten train: launch -> step 1", "hasten import+prepare"} <= rows.keys()
    assert "step_1" in rows["hasten train: launch -> step 1"]


def test_quick_b5_variant_trains_with_its_own_keys(capsys, tmp_path):
    _, payload = run_bench(capsys, "--workloads", "B5", "--peers", "none", "--b5-dir", str(tmp_path / "b5"),
                           "--b5-variant", "lr:train.lr=3e-3,train.weight_decay=0.1")
    check_b5(payload, {"hasten", "hasten lr"}, [0])
    settings = payload["workloads"]["B5"]["settings"]
    assert settings["hasten lr"]["train"]["lr"] == 3e-3 and settings["hasten lr"]["train"]["weight_decay"] == 0.1
    assert settings["hasten"]["train"]["lr"] == 1e-5  # the plain run keeps the config's
    # TRL's schedule on hasten's side: warmup from lr 0, as transformers' schedules
    assert settings["hasten"]["train"]["warmup_from_zero"] is True and settings["hasten lr"]["train"]["warmup_from_zero"]


def test_b5_counts_the_checkpoints_a_run_writes():
    from hasten.bench.b5 import B5Options, checkpoints_per_run

    assert checkpoints_per_run(B5Options(minutes=8, mark_minutes=0), 30) == 30  # one per step
    assert checkpoints_per_run(B5Options(minutes=8, mark_minutes=1), 30) == 9  # 8 marks and the last
    assert checkpoints_per_run(B5Options(minutes=8, mark_minutes=1), 5) == 5  # never more than the steps


def test_b5_refuses_a_disk_its_checkpoints_cannot_fit(capsys, monkeypatch, tmp_path):
    import collections
    import shutil

    usage = collections.namedtuple("usage", "total used free")
    # 32 MiB free: less than the fixed 64 MiB margin, whatever the tiny model's checkpoints weigh
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 40, 0, 32 << 20))
    directory = tmp_path / "b5"
    assert main(["--quick", "--workloads", "B5", "--peers", "none", "--b5-dir", str(directory),
                 "--b5-keep-checkpoints"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and "--b5-dir" in err[-1] and "GiB are free" in err[-1]
    assert not any(directory.iterdir())  # refused before any run trained or wrote a checkpoint


def test_variants_run_before_each_seeds_peer():
    from pathlib import Path

    from hasten.bench.b5 import B5Options, add_variants, plan_runs

    b5 = B5Options(seeds=[0, 1])
    plans = add_variants(plan_runs(b5, ["trl"], Path("d")), [("bf16", [("train.precision", "bf16")])],
                         Path("d"), [0, 1])
    assert [(p.label, p.seed) for p in plans] == [("hasten", 0), ("hasten bf16", 0), ("trl gc=off", 0),
                                                  ("hasten", 1), ("hasten bf16", 1), ("trl gc=off", 1)]
    assert plans[1].overrides == [("train.precision", "bf16")] and plans[0].overrides == []


def test_trl_bf16_is_passed_to_grpo_config():
    from hasten.bench.peers import trl_settings
    from hasten.config import load_config

    cfg = load_config("configs/b1.yaml")
    assert trl_settings(cfg, False, 3)["bf16"] is False
    assert trl_settings(cfg, False, 3, bf16=True)["bf16"] is True


@slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed (hasten[bench])")
def test_b1_against_trl(capsys):
    _, payload = run_bench(capsys, "--workloads", "B1", "--peers", "trl")
    rows = rows_of(payload, "B1")
    for label in ("trl gc=off", "trl gc=on"):
        assert rows[label]["baseline"] == "hasten"
        assert payload["workloads"]["B1"]["settings"][label]["num_generations"] == 4
        assert rows[label]["page_faults"] >= 0  # read from the worker's /proc/PID/stat
        assert rows[label]["peak_rss_mib"] > 100  # the TRL worker's own peak: it holds the model


def test_minor_faults_counts_this_process():
    from hasten.bench.machine import minor_faults

    import mmap

    # A fresh anonymous mapping (not the allocator's, which may hand back pages an earlier test already
    # touched): each of its 16384 pages faults once when first written
    region = mmap.mmap(-1, 64 << 20)
    before = minor_faults()
    for offset in range(0, len(region), mmap.PAGESIZE):
        region[offset] = 1
    assert minor_faults() - before >= 1000
    region.close()


@pytest.mark.parametrize("argv, message", [
    (["--workloads", "B9"], "unknown workload"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--peers", "deepspeed"], "unknown peer"),
    (["--batch-sizes", "1,x"], "--batch-sizes must be a comma list"),
    (["--workloads", "B3", "--speculative", "ngram"], "add B2 to --workloads"),
])
def test_bad_arguments_are_one_line_errors(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_ratio_is_median_of_pairs_and_json_is_strict():
    hasten = Row("hasten", "hasten", "s/step", [1.0, 2.0, 3.0], flops=[2e9, 2e9, 2e9])
    peer = Row("peer", "peer", "s/step", [2.0, 2.0, 9.0])
    assert pair_ratio(peer, hasten) == 2.0  # pairs 2, 1, 3
    assert mfu(hasten, 2.0) == pytest.approx(0.5)  # median rate 1 GFLOP/s of 2
    result = Result("B1", "test", [hasten, peer], notes=[])
    hasten.extra["reward_mean"] = float("nan")
    payload = json.loads(to_json([result], 2.0, {"model": "tiny"}))
    assert payload["workloads"]["B1"]["rows"][0]["reward_mean"] is None
    assert payload["workloads"]["B1"]["ratios"] == {"peer/hasten": 2.0}


@pytest.mark.parametrize("choice, expected", [("both", (False, True)), ("off", (False,)), ("on", (True,))])
def test_trl_checkpointing_option_picks_the_trl_processes(choice, expected):
    from hasten.bench.command import options, parser

    opts = options(parser().parse_args(["--trl-checkpointing", choice]))
    assert opts.trl_checkpointing == expected


def test_recording_engine_passes_weight_updates_through():
    from hasten.bench.workloads import RecordingEngine

    class Engine:
        changed = 0

        def weights_changed(self):
            self.changed += 1

    inner = Engine()
    recorder = RecordingEngine(inner)
    assert hasattr(recorder, "weights_changed")  # what grpo_step checks before telling the engine
    recorder.weights_changed()
    assert inner.changed == 1


# ------------------------------------------------------------------ contention: busy neighbours


def burner_children() -> set[int]:
    """Pids of this process's children that run contention.py's burner."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            command = open(f"/proc/{entry}/cmdline", "rb").read()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == os.getpid() and b"os.getppid() == parent" in command:
            pids.add(int(entry))
    return pids


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_neighbours_run_inside_the_block_and_are_gone_after_it_also_on_error():
    from hasten.bench.contention import Neighbours

    with Neighbours(2) as neighbours:
        pids = neighbours.pids
        assert len(pids) == 2 and all(alive(pid) for pid in pids) and burner_children() == set(pids)
    assert not any(alive(pid) for pid in pids) and not burner_children()
    with pytest.raises(RuntimeError, match="workload failed"):
        with Neighbours(1) as neighbours:
            pids = neighbours.pids
            assert burner_children() == set(pids)
            raise RuntimeError("workload failed")
    assert not any(alive(pid) for pid in pids) and not burner_children()
    with Neighbours(0) as neighbours:
        assert neighbours.pids == [] and not burner_children()


def test_contention_levels_wrap_a_workload_and_end_when_it_raises(monkeypatch):
    import hasten.bench.b5

    seen = []

    def failing_b5(opts):
        seen.append(burner_children())
        raise RuntimeError("B5 failed")

    monkeypatch.setattr(hasten.bench.b5, "run_b5", failing_b5)
    with pytest.raises(RuntimeError, match="B5 failed"):
        main(["--quick", "--workloads", "B5", "--peers", "none", "--contention", "1"])
    assert len(seen) == 1 and len(seen[0]) == 1  # one neighbour while B5 ran
    assert not any(alive(pid) for pid in seen[0]) and not burner_children()


def test_quick_b1_at_two_contention_levels(capsys):
    _, payload = run_bench(capsys, "--workloads", "B1", "--peers", "none", "--contention", "0,1")
    rows = rows_of(payload, "B1")
    assert set(rows) == {"hasten", "hasten +1 busy"}
    assert len(rows["hasten"]["seconds"]) == len(rows["hasten +1 busy"]["seconds"])  # paired by round
    assert "load_before" in rows["hasten +1 busy"] and "load_before" not in rows["hasten"]
    slowdowns = payload["workloads"]["B1"]["settings"]["contention"]
    busy, idle = rows["hasten +1 busy"]["seconds"], rows["hasten"]["seconds"]
    assert slowdowns == {"hasten +1 busy / hasten": pytest.approx(statistics.median(
        b / i for b, i in zip(busy, idle)))}
    assert payload["contention"] == [0, 1] and not burner_children()


@pytest.mark.parametrize("argv, message", [
    (["--contention", "one"], "--contention"),
    (["--contention", "1,1"], "appears twice"),
    (["--workloads", "B5", "--seeds", "a"], "--seeds"),
    (["--workloads", "B5", "--profiles", "fastest"], "unknown profile"),
    (["--workloads", "B5", "--b5-minutes", "0"], "--b5-minutes"),
    (["--workloads", "B5", "--b5-variant", "bf16"], "--b5-variant"),
    (["--workloads", "B5", "--b5-variant", "bf16:train.precision"], "--b5-variant"),
    (["--workloads", "B5", "--b5-variant", ":train.precision=bf16"], "--b5-variant"),
])
def test_bad_contention_and_b5_arguments(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------ header: matmul rates at the model's shapes


def test_header_has_matmul_rates_at_the_model_shapes_and_wait_variables():
    from hasten.bench.machine import machine_figures, matmul_at_shapes, model_shapes
    from hasten.models.tiny import tiny_model

    config = tiny_model(300).config
    shapes = model_shapes(config)  # (K, N) of x @ W.T
    assert shapes["head"] == (config.hidden_size, 300) and shapes["down"] == (config.intermediate_size,
                                                                               config.hidden_size)
    rates = matmul_at_shapes(config, quick=True)
    assert list(rates) == ["M=128", "M=16"]
    for per_shape in rates.values():
        assert [name.split()[0] for name in per_shape] == ["qkv", "gate_up", "down", "head"]
        assert all({"mkl", "bf16"} <= kernels.keys() for kernels in per_shape.values())
    os.environ["KMP_BLOCKTIME"] = "0"
    try:
        assert machine_figures()["omp_env"]["KMP_BLOCKTIME"] == "0"
    finally:
        del os.environ["KMP_BLOCKTIME"]


# ------------------------------------------------------------------ B5: time to accuracy


def test_training_clock_excludes_saving_and_saves_at_marks_and_at_the_end(tmp_path, monkeypatch):
    """On a fake clock that only a save moves (by 0.05 s): the clock pauses for exactly the save."""
    import hasten.bench.b5
    from hasten.bench.b5 import TrainingClock

    saved, now = [], [100.0]
    monkeypatch.setattr(hasten.bench.b5.time, "perf_counter", lambda: now[0])

    def save(target):
        saved.append(target.name)
        now[0] += 0.05

    clock = TrainingClock(minutes=10, mark_minutes=5, directory=tmp_path)
    assert not clock.after_step(1, {"seconds": 0.1}, save, last=False)  # before the first mark: no save
    assert clock.after_step(2, {"seconds": 0.1}, save, last=True)  # the end: saved, stop
    assert saved == ["step-2"] and clock.paused == pytest.approx(0.05) and clock.seconds() == pytest.approx(0.0)
    assert [c["step"] for c in clock.checkpoints] == [2] and clock.checkpoints[0]["save_seconds"] == pytest.approx(0.05)
    every = TrainingClock(minutes=10, mark_minutes=0, directory=tmp_path)  # mark 0: after every step
    for step in (1, 2, 3):
        every.after_step(step, {}, save, last=False)
    assert [c["step"] for c in every.checkpoints] == [1, 2, 3]
    spent = TrainingClock(minutes=1e-9, mark_minutes=5, directory=tmp_path)  # budget spent: save and stop
    now[0] += 1.0  # a step's training time
    assert spent.after_step(1, {}, save, last=False) and [c["step"] for c in spent.checkpoints] == [1]


def test_minutes_to_target_is_the_first_point_at_or_above_it():
    import math

    from hasten.bench.b5 import minutes_to_target

    curve = [[0.0, 0, 0.3], [1.0, 4, 0.45], [2.5, 9, 0.5], [4.0, 14, 0.7]]
    assert minutes_to_target(curve, 0.5) == 2.5
    assert math.isinf(minutes_to_target(curve, 0.8))


def test_scorer_loads_a_transformers_saved_checkpoint_in_place(tmp_path):
    """TRL's checkpoints are save_pretrained dirs: scoring one must evaluate exactly its weights."""
    import torch

    from hasten.bench.b5 import DEMO_CONFIG, QUICK_OVERRIDES, Scorer
    from hasten.config import load_config
    from hasten.models.tiny import tiny_model, tiny_tokenizer

    scorer = Scorer(load_config(DEMO_CONFIG, QUICK_OVERRIDES), lambda text: None)
    try:
        assert 0 <= scorer.base["accuracy"] <= 1
        other = tiny_model(len(tiny_tokenizer()), seed=7)  # different weights than the session's (seed 0)
        other.save_pretrained(tmp_path / "checkpoint")
        metrics = scorer.score(tmp_path / "checkpoint")
        assert 0 <= metrics["accuracy"] <= 1 and metrics["num_examples"] == 8
        loaded = dict(scorer.session.policy.model.named_parameters())
        for name, parameter in other.named_parameters():
            assert torch.equal(loaded[name].detach(), parameter.detach()), name
    finally:
        scorer.close()


def check_b5(payload: dict, labels: set[str], seeds: list[int]) -> dict:
    from pathlib import Path

    b5 = payload["workloads"]["B5"]
    rows = {row["name"]: row for row in b5["rows"]}
    assert set(rows) == labels
    settings = b5["settings"]["b5"]
    base = settings["base_accuracy"]
    assert 0 <= base <= 1 and settings["target_accuracy"] == pytest.approx(base + 0.2)
    directory = Path(settings["directory"])
    assert Path(settings["plot"]).is_file() and (directory / "curves.json").is_file()
    for label in labels:
        assert len(rows[label]["seconds"]) == len(seeds) and 0 <= rows[label]["final_accuracy"] <= 1
        for seed in seeds:
            curve = b5["settings"]["curves"][label][str(seed)]
            assert curve[0] == [0.0, 0, base]  # the base model, scored once, starts every curve
            assert [step for _, step, _ in curve] == [0, 1, 2]  # --quick: 2 steps, a checkpoint after each
            assert all(0 <= accuracy <= 1 for _, _, accuracy in curve)
            minutes = [m for m, _, _ in curve]
            assert minutes == sorted(minutes)
            run_dir = next(p for p in directory.iterdir() if p.name.endswith(f"seed{seed}")
                           and p.name.startswith(label.split()[0]) and (p / "run.json").is_file()
                           and json.loads((p / "run.json").read_text())["checkpoints"])
            assert (run_dir / "step-2").is_dir() and not list((run_dir / "step-2").glob("*.safetensors"))
    return rows


def test_quick_b5_hasten_side(capsys, tmp_path):
    _, payload = run_bench(capsys, "--workloads", "B5", "--peers", "none", "--b5-dir", str(tmp_path / "b5"),
                           "--seeds", "0,1")
    rows = check_b5(payload, {"hasten"}, [0, 1])
    assert rows["hasten"]["steps"] == 2 and rows["hasten"]["unit"] == "min"
    assert payload["workloads"]["B5"]["settings"]["hasten"]["train"]["steps"] == 2


def test_b5_only_profiles_skips_the_config_run(capsys, tmp_path):
    """--b5-only-profiles: the hasten runs are the variants (and profiles) alone; without any it is refused."""
    _, payload = run_bench(capsys, "--workloads", "B5", "--peers", "none", "--b5-dir", str(tmp_path / "b5"),
                           "--b5-only-profiles", "--b5-variant", "lr:train.lr=2e-5")
    check_b5(payload, {"hasten lr"}, [0])
    assert payload["workloads"]["B5"]["settings"]["hasten lr"]["train"]["lr"] == 2e-5
    assert not (tmp_path / "b5" / "hasten-seed0").exists()
    code = main(["--workloads", "B5", "--quick", "--peers", "none", "--b5-only-profiles", "--json-only"])
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(error) == 1 and "--b5-only-profiles" in error[0]


@slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed (hasten[bench])")
def test_quick_b5_against_trl_with_a_profile(capsys, tmp_path):
    _, payload = run_bench(capsys, "--workloads", "B5", "--peers", "trl", "--profiles", "balanced",
                           "--b5-dir", str(tmp_path / "b5"))
    rows = check_b5(payload, {"hasten", "hasten balanced", "trl gc=off"}, [0])
    assert rows["trl gc=off"]["baseline"] == "hasten"
    trl = payload["workloads"]["B5"]["settings"]["trl gc=off"]
    assert trl["gradient_checkpointing"] is False and trl["max_steps"] == 2 and trl["num_generations"] == 4


def test_trl_schedule_follows_hasten_schedule():
    from types import SimpleNamespace

    from hasten.bench.peers import PeerError, trl_schedule

    def train(schedule, warmup=0, floor=0.0):
        return SimpleNamespace(lr_schedule=schedule, warmup_steps=warmup, min_lr_ratio=floor)

    assert trl_schedule(train("constant")) == {"lr_scheduler_type": "constant"}
    assert trl_schedule(train("constant", 3)) == {"lr_scheduler_type": "constant_with_warmup"}
    assert trl_schedule(train("cosine", 3)) == {"lr_scheduler_type": "cosine"}
    assert trl_schedule(train("linear")) == {"lr_scheduler_type": "linear"}
    assert trl_schedule(train("cosine", 0, 0.1)) == {"lr_scheduler_type": "cosine_with_min_lr",
                                                     "lr_scheduler_kwargs": {"min_lr_rate": 0.1}}
    with pytest.raises(PeerError):
        trl_schedule(train("linear", 0, 0.1))
