"""`hasten bench --quick` on the tiny model: every workload runs, prints its
table, and ends with exactly one JSON line holding positive numbers.

Benchmarks are not tests: nothing here asserts a timing or a ratio's size.
The TRL peer test starts two extra processes (~30 s) and is skipped where
`trl` (the `hasten[bench]` extra) does not import.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from hasten.bench import main
from hasten.bench.report import Result, Row, mfu, pair_ratio, to_json


def run_bench(capsys, *argv: str) -> tuple[str, dict]:
    code = main(["--quick", *argv])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.strip().splitlines()
    return "\n".join(lines[:-1]), json.loads(lines[-1])  # the JSON line comes last


def rows_of(payload: dict, workload: str) -> dict[str, dict]:
    rows = {row["name"]: row for row in payload["workloads"][workload]["rows"]}
    for row in rows.values():
        assert row["median"] > 0 and row["min"] > 0 and row["max"] >= row["min"]
        assert row["seconds"] and all(seconds > 0 for seconds in row["seconds"])
    return rows


def test_b1_b2_b3_with_transformers_peer(capsys):
    table, payload = run_bench(capsys, "--workloads", "B1,B2,B3", "--peers", "hf")
    assert "engine/peer" in table and "settings" in table
    assert {"model", "cpus", "torch_threads", "peak_gflops", "workloads"} <= payload.keys()
    assert payload["model"] == "tiny" and payload["peak_gflops"] > 0
    assert set(payload["workloads"]) == {"B1", "B2", "B3"}

    hasten = rows_of(payload, "B1")["hasten"]
    assert hasten["unit"] == "s/step" and hasten["mfu"] > 0
    assert hasten["generate"] > 0 and hasten["learn"] > 0 and hasten["first_step"] > 0
    assert 0 <= hasten["reward_mean"] <= 1.25  # format 0.25 + correct 1.0
    assert payload["workloads"]["B1"]["settings"]["hasten"]["task"]["worked_example"] is False

    decode = rows_of(payload, "B2")
    assert {"kv-cache", "hf generate"} <= decode.keys()
    assert all(row["work"] == [2 * 4 * 8] * 2 for row in decode.values())  # EOS never ends a row
    assert decode["hf generate"]["ratio"] > 0 and decode["hf generate"]["baseline"] == "kv-cache"
    assert payload["workloads"]["B2"]["ratios"]["hf generate/kv-cache"] > 0

    learning = rows_of(payload, "B3")
    assert set(learning) == {"packed", "padded"}
    assert learning["padded"]["ratio"] > 0 and learning["packed"]["mfu"] > 0


def test_b4_startup_json_only(capsys):
    code = main(["--quick", "--workloads", "B4", "--peers", "none", "--json-only"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and len(lines) == 1
    rows = rows_of(json.loads(lines[0]), "B4")
    assert {"hasten --help", "hasten train: launch -> step 1", "hasten import+prepare"} <= rows.keys()
    assert rows["hasten train: launch -> step 1"]["step_1"] > 0


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed (hasten[bench])")
def test_b1_against_trl(capsys):
    _, payload = run_bench(capsys, "--workloads", "B1", "--peers", "trl")
    rows = rows_of(payload, "B1")
    for label in ("trl gc=off", "trl gc=on"):
        assert rows[label]["ratio"] > 0 and rows[label]["baseline"] == "hasten"
        assert payload["workloads"]["B1"]["settings"][label]["num_generations"] == 4


@pytest.mark.parametrize("argv, message", [
    (["--workloads", "B9"], "unknown workload"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--peers", "deepspeed"], "unknown peer"),
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
