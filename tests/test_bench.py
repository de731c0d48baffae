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

import pytest

from hasten.bench import main
from hasten.bench.report import Result, Row, mfu, pair_ratio, to_json

slow = pytest.mark.skipif(not os.environ.get("HASTEN_SLOW"), reason="a benchmark run in extra processes; HASTEN_SLOW=1")
ROW_KEYS = {"name", "side", "unit", "median", "min", "max", "seconds", "mfu"}


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
    import hasten.bench

    result = Result("B3", "learning", [Row("packed", "hasten", "s", [1.0, 2.0])])
    monkeypatch.setattr(hasten.bench, "run", lambda opts: ([result], {"model": "tiny"}, 1.0))
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


@slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed (hasten[bench])")
def test_b1_against_trl(capsys):
    _, payload = run_bench(capsys, "--workloads", "B1", "--peers", "trl")
    rows = rows_of(payload, "B1")
    for label in ("trl gc=off", "trl gc=on"):
        assert rows[label]["baseline"] == "hasten"
        assert payload["workloads"]["B1"]["settings"][label]["num_generations"] == 4


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
    assert mfu(hasten, peak_gflops=2.0) == pytest.approx(0.5)  # median rate 1 GFLOP/s of 2
    result = Result("B1", "test", [hasten, peer], notes=[])
    hasten.extra["reward_mean"] = float("nan")
    payload = json.loads(to_json([result], 2.0, {"model": "tiny"}))
    assert payload["workloads"]["B1"]["rows"][0]["reward_mean"] is None
    assert payload["workloads"]["B1"]["ratios"] == {"peer/hasten": 2.0}


@pytest.mark.parametrize("choice, expected", [("both", (False, True)), ("off", (False,)), ("on", (True,))])
def test_trl_checkpointing_option_picks_the_trl_processes(choice, expected):
    from hasten.bench import _options, _parser

    opts = _options(_parser().parse_args(["--trl-checkpointing", choice]))
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
