"""What a TRL-style trainer is handed, turned into hasten's parts: Policy, RewardFunctions, Task.

- model: a registry name ("tiny", "smollm2-135m"), a model directory or a
  hub id (loaded as the CLI loads it, the native Llama where it applies), or
  a loaded model (a transformers PreTrainedModel, a peft model, or hasten's
  NativeLlamaForCausalLM), used as it is: trained in place.
- processing_class: the tokenizer; None loads the model's own (by name).
- chat_template_path (SFT): a template file, or a tokenizer whose template is cloned (use_chat_template).
- peft_config: a peft LoraConfig, applied with peft.get_peft_model exactly
  as given (every LoraConfig option works; the run's config.yaml records r,
  alpha, dropout and target modules).
- reward_funcs: a callable, a 'file.py:function' or 'package.module:function'
  string, a reward model (a directory, hub id or loaded sequence-classification
  model, with reward_processing_classes), or a list mixing them, in the order
  reward_weights follow.
- train_dataset / eval_dataset: see tasks/data.py (rows_from).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ..config import Config
from ..models import ALIASES, Policy, load_policy, mark_lora_base
from ..rewards.runner import RewardFunction, load_reward
from ..tasks.base import Task
from ..tasks.data import rows_from
from ..ticker import Ticker
from .grpo_config import APIError


def model_name(model: Any) -> str:
    """What config.yaml records as model.name: the string, or a loaded model's name_or_path."""
    if isinstance(model, str):
        return model
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return str(name) if name else type(model).__name__


def build_policy(model: Any, cfg: Config, processing_class: Any = None, peft_config: Any = None,
                 log: Callable[[str], None] = print, chat_template_path: str | None = None,
                 prompt_learning: bool = False) -> Policy:
    """The Policy the run trains (cfg.model.name already set from `model`). chat_template_path: TRL's
    (use_chat_template), applied before the adapters, as TRL does. prompt_learning: peft's prompt
    tuning, p-tuning and prefix tuning are accepted (SFT's padded pass runs the peft model's own forward,
    which adds their virtual tokens; GRPO's engines do not, so there they stay an error)."""
    from ..rollout.factory import use_native_model

    if isinstance(model, str):
        clones = chat_template_path is not None and not is_template_file(chat_template_path)  # may resize
        native = peft_config is None and processing_class is None and not clones and use_native_model(cfg, log)
        log(f"loading model {cfg.model.name} ...")  # as the CLI says it (train/trainer.py): the load takes seconds
        with Ticker(f"loading model {cfg.model.name}", unit="s") as tick:  # elapsed; a first conversion counts
            policy = load_policy(cfg.model, tick.wrap(log), native=native)
    else:
        if not hasattr(model, "parameters") or not callable(model):
            raise APIError(f"GRPOTrainer: model must be a name, a directory or a loaded causal LM "
                           f"(got {type(model).__name__})")
        learned = [config for config in getattr(model, "peft_config", {}).values()
                   if getattr(config, "is_prompt_learning", False)]
        if learned and not prompt_learning:  # its virtual tokens are not in GRPO's engines: none would be sampled
            raise APIError(f"peft: a {type(learned[0]).__name__} model is not supported for GRPO (hasten samples "
                           "without prompt learning's virtual tokens: give a peft LoraConfig)")
        tokenizer = processing_class if processing_class is not None else _tokenizer_for(model)
        policy = Policy(model=model, tokenizer=tokenizer, source=model_name(model), lora=hasattr(model, "peft_config"))
    if processing_class is not None:
        policy.tokenizer = processing_class
    if chat_template_path is not None:
        use_chat_template(policy, chat_template_path)
    if policy.tokenizer.pad_token_id is None:
        policy.tokenizer.pad_token = policy.tokenizer.eos_token
    if peft_config is not None and prompt_learning and getattr(peft_config, "is_prompt_learning", False):
        policy = _with_prompt_learning(policy, peft_config)
    elif peft_config is not None:
        policy = _with_lora(policy, peft_config, cfg)
    policy.model.train()
    return policy


def is_template_file(path: str) -> bool:
    return Path(path).is_file() and path.endswith((".jinja", ".j2"))


def use_chat_template(policy: Policy, path: str) -> None:
    """TRL's chat_template_path. A .jinja / .j2 file becomes the tokenizer's chat template, as it is (the
    tokens it names must be in the vocabulary already). A tokenizer directory (or hub id) lends its template,
    its added tokens and its EOS, and the model's embeddings grow to the vocabulary (to a multiple of 64, the
    rest filled with <extra_id_N> tokens): TRL's clone_chat_template, step for step."""
    if is_template_file(path):
        policy.tokenizer.chat_template = Path(path).read_text(encoding="utf-8")
        return
    from transformers import AddedToken, AutoTokenizer

    model, tokenizer = policy.model, policy.tokenizer
    if getattr(model, "hasten_native", False) or not hasattr(model, "resize_token_embeddings"):
        raise APIError(f"SFTConfig: chat_template_path={path!r} (a tokenizer to clone) is not supported on "
                       f"{type(model).__name__}: it cannot resize its embeddings (pass the model by name)")
    try:
        source = AutoTokenizer.from_pretrained(path)
    except Exception as error:  # OSError for a missing directory; anything the hub raises offline
        raise APIError(f"SFTConfig: chat_template_path={path!r} is neither a .jinja / .j2 file nor a tokenizer "
                       f"({type(error).__name__})") from None
    tokenizer.chat_template = source.get_chat_template()
    tokenizer.add_tokens([token for token in source.added_tokens_decoder.values()
                          if token.content not in tokenizer.vocab])
    tokenizer.eos_token = source.eos_token
    model.config.get_text_config().eos_token_id = tokenizer.eos_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.resize_token_embeddings(new_num_tokens=len(tokenizer.vocab), pad_to_multiple_of=64)
    index = 0
    while model.get_input_embeddings().weight.shape[0] > len(tokenizer.vocab):  # the padding rows get names
        tokenizer.add_tokens(AddedToken(f"<extra_id_{index}>"))
        index += 1


def _tokenizer_for(model: Any):
    name = model_name(model)
    if ALIASES.get(name.lower()) == "tiny":
        from ..models.tiny import tiny_tokenizer

        return tiny_tokenizer()
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    except Exception as error:  # OSError for unknown names; anything the hub raises offline
        raise APIError(f"GRPOTrainer: cannot load a tokenizer for '{name}' ({type(error).__name__}); "
                       "pass processing_class=") from None


def is_prompt_learning(model: Any) -> bool:
    """A peft model whose adapter is prompt tuning, p-tuning or prefix tuning (virtual tokens)."""
    return any(getattr(config, "is_prompt_learning", False) for config in getattr(model, "peft_config", {}).values())


def _with_prompt_learning(policy: Policy, peft_config: Any) -> Policy:
    """peft's get_peft_model with a prompt-learning config, as TRL applies it: only the virtual tokens train."""
    from peft import get_peft_model

    if hasattr(policy.model, "peft_config"):
        raise APIError("SFTTrainer: the model already has peft adapters; pass peft_config=None")
    if getattr(policy.model, "hasten_native", False):
        raise APIError("SFTTrainer: peft needs a transformers model, not hasten's native Llama "
                       "(pass the model by name, or speed={'model_impl': 'hf'})")
    return Policy(model=get_peft_model(policy.model, peft_config), tokenizer=policy.tokenizer, source=policy.source,
                  lora=True)


def _with_lora(policy: Policy, peft_config: Any, cfg: Config) -> Policy:
    from peft import get_peft_model

    if hasattr(policy.model, "peft_config"):
        raise APIError("GRPOTrainer: the model already has peft adapters; pass peft_config=None")
    if getattr(policy.model, "hasten_native", False):
        raise APIError("GRPOTrainer: peft needs a transformers model, not hasten's native Llama "
                       "(pass the model by name, or speed={'model_impl': 'hf'})")
    if not hasattr(peft_config, "target_modules") or not hasattr(peft_config, "r"):
        raise APIError(f"peft_config: {type(peft_config).__name__} is not supported (hasten trains LoRA adapters: "
                       "give a peft LoraConfig)")
    targets = peft_config.target_modules
    cfg.model.lora = True  # the record in config.yaml; the adapters are peft_config's, as given
    cfg.model.lora_r, cfg.model.lora_alpha = int(peft_config.r), int(peft_config.lora_alpha)
    cfg.model.lora_dropout = float(peft_config.lora_dropout)
    if isinstance(targets, (list, set, tuple)):
        cfg.model.lora_target_modules = sorted(targets)
    mark_lora_base(policy.model, policy.tokenizer, cfg.model.name, print)  # a base peft can load from the checkpoint
    model = get_peft_model(policy.model, peft_config)
    return Policy(model=model, tokenizer=policy.tokenizer, source=policy.source, lora=True)


def build_rewards(reward_funcs: Any, reward_processing_classes: Any = None,
                  chat_template_kwargs: dict | None = None, optional: bool = False) -> list[RewardFunction]:
    """RewardFunctions in the given order (reward_weights follow it); reward models as TRL takes them:
    an id or directory, or a loaded sequence-classification model, tokenized with the matching entry of
    reward_processing_classes or the model's own tokenizer (rewards/reward_model.py). optional: an
    environment_factory may own the reward (get_reward), so none given is not an error here (prepare checks
    that some reward exists)."""
    from ..rewards.reward_model import RewardModel, is_model, is_model_spec, load_reward_model

    if reward_funcs is None and optional:
        return []
    if reward_funcs is None:
        raise APIError("No reward source provided: GRPOTrainer needs reward_funcs (a function, a 'module:function' "
                       "string, a reward model, or a list), or an environment_factory whose environment has get_reward")
    given = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    tokenizers = [None] * len(given) if reward_processing_classes is None else (
        list(reward_processing_classes) if isinstance(reward_processing_classes, (list, tuple))
        else [reward_processing_classes])
    if len(tokenizers) != len(given):  # TRL's words, which scripts and tests match
        raise APIError(f"The number of reward processing classes ({len(tokenizers)}) must match the number of "
                       f"reward functions ({len(given)}).")
    functions = []
    for index, (item, tokenizer) in enumerate(zip(given, tokenizers)):
        if isinstance(item, str) and is_model_spec(item):
            model = load_reward_model(item, tokenizer, chat_template_kwargs=chat_template_kwargs)
            functions.append(RewardFunction(name=model.__name__, fn=model, deterministic=True))
        elif isinstance(item, str):
            if ":" not in item:
                raise APIError(f"GRPOTrainer: reward_funcs[{index}] '{item}' is neither a model directory nor a "
                               "'file.py:function' / 'package.module:function' string")
            functions.append(load_reward(item))
        elif is_model(item):
            if tokenizer is None:
                tokenizer = _tokenizer_for(item)
            model = RewardModel(item, tokenizer, chat_template_kwargs)
            functions.append(RewardFunction(name=model.__name__, fn=model, deterministic=True))
        elif callable(item):
            name = getattr(item, "__name__", None) or type(item).__name__
            functions.append(RewardFunction(name=name, fn=item))
        else:
            raise APIError(f"GRPOTrainer: reward_funcs[{index}] must be callable, a reward model or a "
                           f"'module:function' string (got {type(item).__name__})")
    names = [f.name for f in functions]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise APIError(f"GRPOTrainer: two reward functions are named {', '.join(duplicates)} (metrics are per name)")
    return functions


def build_task(train_dataset: Any, eval_dataset: Any, placeholder: list[dict] | None = None,
               fill_prompt: bool = False) -> Task:
    """A Task whose rows are the datasets' (no rewards of its own; answers graded by an "answer" column).

    placeholder: the rows to use when there is no train_dataset (an environment makes the prompts);
    fill_prompt: rows without a "prompt" get an empty user message (TRL, with an environment_factory).
    """
    from ..tasks.jsonl import check_answer_column

    if train_dataset is None and placeholder is None:
        raise APIError("GRPOTrainer: `train_dataset` is required unless an `environment_factory` is provided (its "
                       "reset makes the prompts)")
    train_rows = rows_from(_filled(train_dataset, fill_prompt) if train_dataset is not None else placeholder,
                           "train_dataset")
    eval_rows = rows_from(_filled(eval_dataset, fill_prompt), "eval_dataset") if eval_dataset is not None else []
    return Task(name="dataset", description="rows given to the Python API", train_rows=train_rows,
                eval_rows=eval_rows, reward_functions=[], check=check_answer_column)


def _filled(dataset: Any, fill_prompt: bool) -> Any:
    """With an environment_factory, a row may carry no prompt (reset makes it): an empty user message."""
    if not fill_prompt or isinstance(dataset, (str, Path)):
        return dataset
    rows = dataset.to_list() if hasattr(dataset, "to_list") else dataset
    if not isinstance(rows, (list, tuple)):
        return dataset
    return [{"prompt": [{"role": "user", "content": ""}], **row} if isinstance(row, dict) else row for row in rows]


def named_eval_sets(eval_dataset: Any, fill_prompt: bool = False) -> dict[str | None, list[dict[str, Any]]]:
    """eval_dataset as TRL takes it: one dataset -> {None: rows}; a dict of datasets (or a DatasetDict)
    -> {name: rows}, each evaluated and logged under eval_<name>_*; None -> {}. fill_prompt: as build_task."""
    if eval_dataset is None:
        return {}
    if isinstance(eval_dataset, dict):
        if not eval_dataset:
            raise APIError("GRPOTrainer: eval_dataset is an empty dict")
        return {str(name): rows_from(_filled(dataset, fill_prompt), f"eval_dataset['{name}']")
                for name, dataset in eval_dataset.items()}
    return {None: rows_from(_filled(eval_dataset, fill_prompt), "eval_dataset")}
