"""TRL's GRPOTrainer surface and errors that issue 53 found missing, guarded offline on tiny models.

Each test is written from what a test of TRL main's tests/test_grpo_trainer.py (f2cd57710) asserts, and runs
on both libraries by the `lib` switch (conftest.py): TRL 1.16.0 is the control. The TRL test each one stands
for is named in its docstring.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import prompt_dataset
from .test_trl_conformance import assert_trained, grpo_args, snapshot, varied_reward


@pytest.fixture(scope="module")
def glm4_moe(tmp_path_factory) -> str:
    """A tiny GLM-4 MoE: a mixture of experts (output_router_logits) whose config declares no
    router_aux_loss_coef and whose forward returns no router loss (aux_loss None)."""
    import transformers

    from hasten.models.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    config = transformers.Glm4MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=4,
        num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(7)
    path = tmp_path_factory.mktemp("glm4-moe") / "glm4_moe"
    transformers.Glm4MoeForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def with_tool_template(source: str, path) -> str:
    """A copy of a tiny model whose tokenizer has a tool-calling chat template (hasten's Hermes one, Qwen2.5's
    format), which TRL requires of a tokenizer before it takes tools or environments."""
    import shutil

    from transformers import AutoTokenizer

    from hasten.agent import HERMES_TEMPLATE

    shutil.copytree(source, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = HERMES_TEMPLATE
    try:  # TRL parses tool calls with a response template it knows only for its own templates: Qwen's, the
        # same <tool_call> format (hasten reads no response template, so its side is the same either way)
        from trl.chat_template_utils import qwen3_template

        tokenizer.response_template = qwen3_template
    except ImportError:  # no TRL: its side is skipped
        pass
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tool_model(models, tmp_path_factory) -> str:
    return with_tool_template(models["qwen2"], tmp_path_factory.mktemp("tool-model") / "qwen2_tools")


@pytest.fixture(scope="module")
def moe_tool_model(models, tmp_path_factory) -> str:
    """The tiny Qwen3-MoE (a transformers model on hasten, as TRL's tool tests' model) with the template."""
    return with_tool_template(models["qwen3_moe"], tmp_path_factory.mktemp("moe-tool-model") / "moe_tools")


# ------------------------------------------------------------------ the MoE aux loss's coefficient


def test_moe_without_declared_coef_trains_without_aux_loss(lib, glm4_moe, tmp_path):
    """test_train[tiny-Glm4MoeForCausalLM]: the coefficient is the model config's own (none here: 0), so the
    missing router loss is never multiplied."""
    trainer = lib.GRPOTrainer(model=glm4_moe, reward_funcs=varied_reward, train_dataset=prompt_dataset(),
                              args=grpo_args(lib, tmp_path))
    assert trainer.aux_loss_enabled is False
    before = snapshot(trainer)
    trainer.train()
    assert_trained(trainer, before)
    assert "aux_loss" not in trainer.state.log_history[-1]


def test_a_hybrid_mamba_model_samples_and_trains(lib, models, tmp_path):
    """test_train[tiny-NemotronHForCausalLM-nano]: the hf engine's cache is built from the model's config, so a
    mamba layer gets its conv / ssm state layer, and the group's rows are repeated and dropped on it too."""
    trainer = lib.GRPOTrainer(model=models["nemotron_h"], reward_funcs=varied_reward, train_dataset=prompt_dataset(),
                              args=grpo_args(lib, tmp_path))
    before = snapshot(trainer)
    trainer.train()
    assert_trained(trainer, before)


def test_aux_loss_coef_on_a_dense_model_raises(lib, models, tmp_path):
    """TRL 1.16's construction check: a coefficient for a model that has no router loss to weight."""
    with pytest.raises(ValueError, match="not a Mixture-of-Experts model"):
        lib.GRPOTrainer(model=models["qwen2"], reward_funcs=varied_reward, train_dataset=prompt_dataset(),
                        args=grpo_args(lib, tmp_path, router_aux_loss_coef=0.01))


# ------------------------------------------------------------------ environments: rewards, tools, errors


class ScoredEnvironment:  # owns its reward
    def reset(self, **kwargs):
        self.count = 0

    def act(self, x: int) -> int:
        """
        Act.

        Args:
            x: A value.
        """
        self.count += x
        return self.count

    def get_reward(self) -> float:
        return 1.0


class PlainEnvironment:  # no get_reward: scored by reward_funcs
    def reset(self, **kwargs): ...

    def play(self, x: int) -> int:
        """
        Play.

        Args:
            x: A value.
        """
        return x


def zero_reward(completions, **kwargs):
    return [0.0 for _ in completions]


def environment_args(lib, tmp_path, **fields):
    return grpo_args(lib, tmp_path, max_steps=1, **fields)


def test_environment_owned_reward_coexists_with_reward_funcs(lib, tool_model, tmp_path):
    """test_environment_owned_reward_coexists_with_reward_funcs: reward_weights are reward_funcs' alone; the
    environment's get_reward joins after them with weight 1, and is no tool."""
    trainer = lib.GRPOTrainer(model=tool_model, reward_funcs=zero_reward, environment_factory=ScoredEnvironment,
                              args=environment_args(lib, tmp_path, reward_weights=[0.5]))
    assert trainer.reward_func_names == ["zero_reward", "ScoredEnvironment"]
    assert trainer.reward_weights.tolist() == [0.5, 1.0]
    assert len(trainer.reward_funcs) == 2
    assert [tool.__name__ for tool in trainer.tools] == ["act"]


def test_reward_weights_count_only_reward_funcs(lib, tool_model, tmp_path):
    """TRL's count check is against reward_funcs, the environment's reward not counted."""
    with pytest.raises(ValueError, match=r"Number of reward weights \(2\) must match number of reward functions \(1\)"):
        lib.GRPOTrainer(model=tool_model, reward_funcs=zero_reward, environment_factory=ScoredEnvironment,
                        args=environment_args(lib, tmp_path, reward_weights=[0.5, 1.0]))


def test_environment_owned_reward_mixed_environments(lib, tool_model, tmp_path):
    """test_environment_owned_reward_mixed_environments and test_train_with_multiple_environments' attributes:
    one reward column per get_reward class (two names, one class: one column); each environment's tools."""
    from datasets import Dataset

    trainer = lib.GRPOTrainer(
        model=tool_model, reward_funcs=zero_reward, args=grpo_args(lib, tmp_path),
        train_dataset=Dataset.from_dict({"environment": ["scored", "scored2", "plain"]}),
        environment_factory={"scored": ScoredEnvironment, "scored2": ScoredEnvironment, "plain": PlainEnvironment})
    assert trainer.reward_func_names == ["zero_reward", "ScoredEnvironment"]
    assert trainer.reward_weights.tolist() == [1.0, 1.0]
    assert trainer.reward_funcs[-1](environments=[ScoredEnvironment(), PlainEnvironment()]) == [1.0, None]
    assert [tool.__name__ for tool in trainer._env_tools["scored"]] == ["act"]
    assert [tool.__name__ for tool in trainer._env_tools["plain"]] == ["play"]
    assert {tool.__name__ for tool in trainer.tools} == {"act", "play"}
    assert [len(trainer._environment_pool[name]) for name in ("scored", "scored2", "plain")] == [1, 1, 1]


def test_unknown_environment_raises_at_train(lib, tool_model, tmp_path):
    """test_train_with_unknown_environment_raises: the trainer constructs; train() raises TRL's ValueError."""
    from datasets import Dataset

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Hi"}]] * 3, "environment": ["unknown"] * 3})
    trainer = lib.GRPOTrainer(model=tool_model, reward_funcs=zero_reward, train_dataset=dataset,
                              args=grpo_args(lib, tmp_path), environment_factory={"plain": PlainEnvironment})
    with pytest.raises(ValueError, match="not among the environments"):
        trainer.train()


def test_multiple_environments_without_dataset_raises(lib, tool_model, tmp_path):
    """test_multiple_environments_without_dataset_raises: TRL's words."""
    with pytest.raises(ValueError, match="requires a `train_dataset`"):
        lib.GRPOTrainer(model=tool_model, reward_funcs=zero_reward, args=environment_args(lib, tmp_path),
                        environment_factory={"a": PlainEnvironment, "b": ScoredEnvironment})


# ------------------------------------------------------------------ data loaders and accelerator_config


def streamed(dataset):
    return dataset.to_iterable_dataset()


def test_iterable_dataset_sets_dispatch_batches_false(lib, models, tmp_path):
    """test_train_with_iterable_dataset's construction check."""
    trainer = lib.GRPOTrainer(model=models["qwen2"], reward_funcs=varied_reward,
                              train_dataset=streamed(prompt_dataset()), args=grpo_args(lib, tmp_path))
    assert trainer.args.accelerator_config.dispatch_batches is False


def test_iterable_dataset_requires_dispatch_batches_false(lib, models, tmp_path):
    """test_iterable_dataset_requires_dispatch_batches_false: TRL's words."""
    with pytest.raises(ValueError, match="Iterable datasets require `dispatch_batches=False`"):
        lib.GRPOTrainer(model=models["qwen2"], reward_funcs=varied_reward, train_dataset=streamed(prompt_dataset()),
                        args=grpo_args(lib, tmp_path, accelerator_config={"dispatch_batches": True}))


def test_dataloaders_keep_map_style_workers(lib, models, tmp_path):
    """test_iterable_eval_keeps_map_style_train_workers, and what each loader's first batch holds: the
    generation batch's prompts, each num_generations times in a row."""
    trainer = lib.GRPOTrainer(model=models["qwen2"], reward_funcs=varied_reward, train_dataset=prompt_dataset(),
                              eval_dataset=streamed(prompt_dataset(split="test")),
                              args=grpo_args(lib, tmp_path, dataloader_num_workers=2, per_device_eval_batch_size=3))
    assert trainer.args.dataloader_num_workers == 2
    train_loader = trainer.get_train_dataloader()
    assert train_loader.num_workers == 2
    assert trainer.get_eval_dataloader().num_workers == 0  # a stream: one worker, for that loader only
    assert trainer.args.dataloader_num_workers == 2
    train_loader.num_workers = 0  # the batch's content, without starting workers
    batch = next(iter(train_loader))
    prompts = [row["prompt"] for row in batch]
    assert len(prompts) == 3 and len(set(prompts)) == 1 and prompts[0] in prompt_dataset()["prompt"]


def test_accelerator_config_other_keys_are_refused_on_hasten(lib, tmp_path):
    """hasten runs no accelerate: a key other than dispatch_batches is one line naming it (TRL takes it)."""
    if lib.name == "trl":
        lib.GRPOConfig(output_dir=str(tmp_path), accelerator_config={"split_batches": True}, **lib.machine)
        return
    with pytest.raises(ValueError, match="accelerator_config split_batches=True is not supported") as error:
        lib.GRPOConfig(output_dir=str(tmp_path), accelerator_config={"split_batches": True})
    assert "\n" not in str(error.value)


# ------------------------------------------------------------------ use_liger_kernel


def test_liger_kernel_with_peft_lm_head_raises(lib, models, tmp_path):
    """test_liger_kernel_with_peft_lm_head_raises: TRL's error naming lm_head, at construction."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models["qwen2"], dtype="float32")
    with pytest.raises(ValueError, match="Applying a PEFT adapter to `lm_head` is not supported"):
        lib.GRPOTrainer(model=model, reward_funcs=varied_reward, train_dataset=prompt_dataset(),
                        args=grpo_args(lib, tmp_path, use_liger_kernel=True),
                        peft_config=LoraConfig(target_modules=["q_proj", "v_proj", "lm_head"]))


def test_liger_kernel_is_refused_in_one_line(models, tmp_path):
    """hasten's side only (TRL needs the liger package): use_liger_kernel without a PEFT lm_head is refused."""
    from hasten.api import GRPOConfig, GRPOTrainer

    with pytest.raises(ValueError, match="use_liger_kernel=True is not supported by hasten") as error:
        GRPOTrainer(model=models["qwen2"], reward_funcs=varied_reward, train_dataset=prompt_dataset(),
                    args=GRPOConfig(output_dir=str(tmp_path), max_steps=1, use_liger_kernel=True))
    assert "\n" not in str(error.value)


# ------------------------------------------------------------------ the private sample log


def test_log_extra_reaches_logs(lib, models, tmp_path):
    """test_train_reward_func_with_log_extra: a log_extra column is in trainer._logs["extra"]."""
    def reward_func(completions, **kwargs):
        kwargs["log_extra"]("test_column", [completion[:5] for completion in completions])
        return [float(len(completion)) for completion in completions]

    trainer = lib.GRPOTrainer(model=models["qwen2"], reward_funcs=reward_func, train_dataset=prompt_dataset(),
                              args=grpo_args(lib, tmp_path, max_steps=1, log_completions=True))
    trainer.train()
    assert "test_column" in trainer._logs["extra"]
    assert len(trainer._logs["extra"]["test_column"]) == len(trainer._logs["completion"]) == 3


# ------------------------------------------------------------------ scripted model.generate


def scripted(tokenizer, texts: list[str], width: int) -> torch.Tensor:
    """(len(texts), width) ids: each text, then EOS, then pads (a text may fill the width without EOS)."""
    rows = []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        ids = (ids + [tokenizer.eos_token_id] if not text.endswith("...") else ids)[:width]
        rows.append(ids + [tokenizer.pad_token_id] * (width - len(ids)))
    return torch.tensor(rows)


class CounterEnvironment:
    def reset(self, **kwargs):
        self._counter = 0

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.
        """
        self._counter += step
        return self._counter


def test_scripted_generate_runs_tools_of_environments(lib, moe_tool_model, tmp_path):
    """test_train_with_environment_factory (and test_train_with_tools): a generate patched on the model scripts
    3 completions, two tool calls (one to a tool that does not exist) and a plain answer; the calls run, only
    the valid one changes its environment, and the metrics count them as TRL does."""
    from unittest.mock import patch

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(moe_tool_model)
    call = '<tool_call>\n{"name": "%s", "arguments": {"step": 1}}\n</tool_call>'
    first = scripted(tokenizer, [call % "increment", call % "decrement", "I won't"], 80)
    shapes = []

    def fake_generate(input_ids, **kwargs):
        shapes.append(input_ids.shape[0])
        completion = first if len(shapes) == 1 else scripted(tokenizer, ["Done!"] * input_ids.shape[0], 8)
        return torch.cat([input_ids, completion.to(input_ids.device)], dim=-1)

    trainer = lib.GRPOTrainer(model=moe_tool_model, reward_funcs=varied_reward,
                              environment_factory=CounterEnvironment,
                              args=grpo_args(lib, tmp_path, max_steps=1, max_completion_length=512))
    before = snapshot(trainer)
    with patch.object(trainer.model, "generate", side_effect=fake_generate):
        trainer.train()
    assert shapes[0] == 3  # the group at once (then the rollouts that called a tool, as the length cap allows)
    assert trainer.state.log_history[-1]["tools/call_frequency"] == pytest.approx(2 / 3)
    assert trainer.state.log_history[-1]["tools/failure_frequency"] == pytest.approx(1 / 2)
    assert [environment._counter for environment in trainer.environments] == [1, 0, 0]
    assert_trained(trainer, before)


def test_mask_truncated_with_scripted_generate(lib, models, tmp_path):
    """test_train_with_mask_truncated_completions: transformers' GenerationMixin.generate patched process-wide
    scripts one truncated completion and two that end (one exactly at the cap); the two still train."""
    from unittest.mock import patch

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["qwen2"])
    completion = scripted(tokenizer, ["abcdefgh...", "abc", "abcdefg"], 8)

    def fake_generate(input_ids, **kwargs):
        return torch.cat([input_ids, completion.to(input_ids.device)], dim=1)

    with patch("transformers.generation.utils.GenerationMixin.generate", side_effect=fake_generate):
        trainer = lib.GRPOTrainer(model=models["qwen2"], reward_funcs=varied_reward, train_dataset=prompt_dataset(),
                                  args=grpo_args(lib, tmp_path, max_steps=1, mask_truncated_completions=True,
                                                 loss_type="dapo"))
        before = snapshot(trainer)
        trainer.train()
    assert_trained(trainer, before)


def test_model_generate_engine_cuts_masks_and_scores(models):
    """hasten's engine over a scripted generate: group-major rows, cut after the first EOS or at the cap,
    pads masked, sampling log-probs the policy's own at each kept token and 0 elsewhere."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hasten.rollout import SamplingParams
    from hasten.rollout.model_generate import ModelGenerateEngine, custom_generate

    tokenizer = AutoTokenizer.from_pretrained(models["qwen2"])
    model = AutoModelForCausalLM.from_pretrained(models["qwen2"])
    assert custom_generate(model) is None  # transformers' own: the fast engine samples
    completion = scripted(tokenizer, ["ab", "abcdefgh..."], 6)
    calls = []

    def fake_generate(input_ids, attention_mask, generation_config):
        calls.append((input_ids.shape[0], generation_config.max_new_tokens, generation_config.do_sample))
        return torch.cat([input_ids, completion], dim=1)

    model.generate = fake_generate
    assert custom_generate(model) == "a generate set on the model instance"
    engine = ModelGenerateEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    rollout = engine.generate([tokenizer.encode("Hi there")], 2, SamplingParams(max_new_tokens=5), seed=0)
    assert calls == [(2, 5, True)]
    assert rollout.completion_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert rollout.ended_with_eos.tolist() == [True, False]
    assert rollout.completion_ids[0, 2].item() == tokenizer.eos_token_id
    assert rollout.completion_ids[0, 3:].eq(tokenizer.pad_token_id).all()
    ids = torch.cat([torch.tensor([tokenizer.encode("Hi there")]), rollout.completion_ids[1:]], dim=1)
    with torch.no_grad():
        expected = torch.log_softmax(model(ids).logits[0, -6:-1], dim=-1).gather(-1, ids[0, -5:, None]).squeeze(-1)
    torch.testing.assert_close(rollout.sampling_logprobs[1], expected, rtol=1e-4, atol=1e-5)
    assert rollout.sampling_logprobs[0, 3:].eq(0).all()


def test_subclass_generate_is_planned(models, tmp_path):
    """hasten's side: a model class that overrides generate samples through it from the start, and the plan
    names model.generate; a plain model keeps the fast engine."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

    from hasten.api import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(models["qwen2"])
    calls = []

    class ScriptedQwen2(Qwen2ForCausalLM):
        def generate(self, input_ids, **kwargs):
            calls.append(input_ids.shape[0])
            completion = scripted(tokenizer, ["abc"] * input_ids.shape[0], 4)
            return torch.cat([input_ids, completion], dim=1)

    def make(model):
        return GRPOTrainer(model=model, reward_funcs=varied_reward, train_dataset=prompt_dataset(),
                           args=GRPOConfig(output_dir=str(tmp_path / str(len(calls))), max_steps=1,
                                           per_device_train_batch_size=3, num_generations=3,
                                           max_completion_length=8), log=lambda line: None)

    trainer = make(ScriptedQwen2.from_pretrained(models["qwen2"]))
    assert trainer.session.plan.engine == "model.generate"
    trainer.train()
    assert calls == [3]
    assert make(AutoModelForCausalLM.from_pretrained(models["qwen2"])).session.plan.engine != "model.generate"
