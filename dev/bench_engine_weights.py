"""speed.engine_weights: decode-step time, copy vs shared (and shared on F.linear), SmolLM2-135M, 4 prompts x 8
= 32 rows, fp32, rounds interleaved, medians; and the tensors each engine holds of its own (docs/speedups.md).

    PYTHONPATH=. python dev/bench_engine_weights.py THREADS [ROUNDS]
"""
import statistics, sys, time
import torch
from hasten.config import ModelConfig
from hasten.models import load_policy
from hasten.rollout import SamplingParams
from hasten.rollout.lean import LeanEngine

threads = int(sys.argv[1]); rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
torch.set_num_threads(threads)
policy = load_policy(ModelConfig(name="smollm2-135m"), log=lambda _: None)
model = policy.model.eval()
tok = policy.tokenizer
prompts = [tok(t)["input_ids"] for t in ["What is 12 plus 30?", "Name a colour.", "Write a short poem about the sea.", "hi"]]
engines = {w: LeanEngine(model, policy.pad_token_id, [], weights=w) for w in ("copy", "shared")}  # no EOS: fixed length
engines["shared-F.linear"] = LeanEngine(model, policy.pad_token_id, [], weights="shared")
engines["shared-F.linear"].linear.pointwise = False

def timed(engine):
    """Record the wall time of each forward that ends in logits (the prefill's first, then one per decode step)."""
    layers, logits, record = engine._layers, engine._logits, []
    def timed_layers(hidden, *args):
        engine._start = time.perf_counter(); return layers(hidden, *args)
    def timed_logits(hidden):
        out = logits(hidden)
        record.append(time.perf_counter() - engine._start)
        return out
    engine._layers, engine._logits, engine._record = timed_layers, timed_logits, record
for e in engines.values(): timed(e)

def run(engine, tokens):
    engine._record.clear()
    engine.generate(prompts, 8, SamplingParams(max_new_tokens=tokens), seed=0)
    return statistics.median(engine._record[1:])  # the first is the prefill's logits

LONG = 48
for e in engines.values():
    run(e, 8)
steps = {w: [] for w in engines}
for _ in range(rounds):
    for w, e in engines.items():
        steps[w].append(run(e, LONG))
med = {w: statistics.median(v) for w, v in steps.items()}
print(f"threads={threads} decode step (32 rows): copy {med['copy']*1e3:.2f} ms, shared {med['shared']*1e3:.2f} ms, "
      f"shared/copy {med['shared']/med['copy']:.3f}  (rounds={rounds}, per-round ratios "
      f"{[round(s/c, 3) for s, c in zip(steps['shared'], steps['copy'])]}); shared with F.linear "
      f"{med['shared-F.linear']*1e3:.2f} ms, /copy {med['shared-F.linear']/med['copy']:.3f}, /shared-pointwise "
      f"{med['shared-F.linear']/med['shared']:.3f}")

def held(engine):
    seen, total = set(), 0
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    def walk(v):
        nonlocal total
        if id(v) in seen or isinstance(v, (str, int, float, bool, type(None), torch.nn.Module)): return
        seen.add(id(v))
        if isinstance(v, torch.Tensor):
            if v.is_mkldnn or v.untyped_storage().data_ptr() not in params:
                total += v.numel() * v.element_size()
        elif isinstance(v, dict): [walk(x) for x in v.values()]
        elif isinstance(v, (list, tuple)): [walk(x) for x in v]
        elif hasattr(v, "__dict__"): walk(vars(v))
    walk(vars(engine)); return total
n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
print(f"parameters {n/1e6:.1f}M ({4*n/2**20:.0f} MiB fp32); engine-held tensors: copy {held(engines['copy'])/2**20:.0f} MiB, shared {held(engines['shared'])/2**20:.2f} MiB")
