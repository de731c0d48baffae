"""Re-quantization of SmolLM2-135M's int8 projections (qkv, o, gate_up fused; head), old per-channel
pack vs the new per-tensor levels + output scales; and fp32 oneDNN packing, A/B/A/B in one process.

Run: PYTHONPATH=. python dev/bench_requantize.py THREADS"""
import time, statistics, warnings, sys, torch
warnings.simplefilter("ignore")
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
from hasten.config import ModelConfig
from hasten.models import load_policy
from hasten.kernels import int8
policy = load_policy(ModelConfig(name="smollm2-135m"), log=lambda t: None)
m = policy.model
weights = []
for layer in m.model.layers:
    a, p = layer.self_attn, layer.mlp
    weights += [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(), a.o_proj.weight.detach(),
                torch.cat([p.gate_proj.weight, p.up_proj.weight]).detach()]
weights.append(m.lm_head.weight.detach())
stats = [torch.rand(w.shape[1]) + 0.1 for w in weights]
def old(w, st):
    w = w.float()
    f = int8.smoothing(st, w); w = w * f
    amax = w.abs().amax(dim=1)
    sc = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).double()
    q = torch.quantize_per_channel(w, sc, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(q, None)
def new(w, st): return int8.prepare(w, st)
def fp32(w, st): return torch.ops.mkldnn._reorder_linear_weight(w, 64)
res = {k: [] for k in ("old", "new", "fp32")}
for _ in range(3):
    for name, fn in (("old", old), ("new", new), ("fp32", fp32)):
        t = time.perf_counter(); [fn(w, s) for w, s in zip(weights, stats)]; res[name].append(time.perf_counter() - t)
print(f"threads {torch.get_num_threads()}: " + ", ".join(f"{k} {statistics.median(v):.3f} s" for k, v in res.items()))
