"""The lean engine's decode cache (`GroupCache`): each prompt's K/V stored once for its group, each row's own
K/V preallocated and written in place, and the attention of prefill and decode over both.

rollout/lean.py's module docstring says why it is built this way and what was measured against it;
rollout/speculative.py's RaggedCache extends it to rows of their own lengths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import decode_attention


class GroupCache:
    """K/V of each prompt, stored once per group, and of each row's own tokens, preallocated.

    A decode step attends to the prompt's K/V through a (prompt, group) grid, so
    the prompt part is read once per prompt rather than once per row, and attention
    is memory-bound. After compaction, `rows` maps batch rows into the grid.
    """

    def __init__(self, engine, prompt_mask, num_generations, steps):
        self.engine, self.num_generations = engine, num_generations
        self.num_prompts, self.prompt_width = prompt_mask.shape
        num_rows = self.num_prompts * num_generations
        shape = (num_rows, engine.num_kv_heads, max(steps - 1, 1), engine.head_dim)  # the last token is never fed
        weight = engine.base.model.embed_tokens.weight
        self.prompt: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer, (B, kv, P, head_dim) each
        self.own = [(weight.new_empty(shape), weight.new_empty(shape)) for _ in engine.layers]
        self.length = 0  # own tokens written so far
        self.rows: torch.Tensor | None = None  # grid index of each batch row; None = all, in order
        # speed.decode_attention (kernels/decode_attention.py): the decode step as one fused kernel, which
        # reads each row's prompt through prompt_of_row instead of the grid.
        self.fused = bool(getattr(engine, "decode_attention", False))
        self.prompt_of_row = torch.arange(num_rows, device=prompt_mask.device) // num_generations
        real = prompt_mask.bool()
        causal = torch.ones((self.prompt_width,) * 2, dtype=torch.bool, device=real.device).tril()
        eye = torch.eye(self.prompt_width, dtype=torch.bool, device=real.device)
        # A padding query may attend to itself only, so its row is never empty (no NaN in its K/V).
        self.prompt_attend = ((causal & real[:, None, :]) | eye)[:, None]  # (B, 1, P, P)
        self.prompt_bias = torch.zeros(real.shape, dtype=weight.dtype, device=real.device)
        self.prompt_bias = self.prompt_bias.masked_fill(~real, float("-inf"))[:, None, None]  # (B, 1, 1, P)
        self.bias_rows = self.prompt_bias.view(self.num_prompts, self.prompt_width)  # (B, P), the kernel's

    def attend_prompt(self, layer, query, key, value):
        """Prefill: query (B, heads, P, head_dim), key/value (B, kv, P, head_dim) -> (B, P, heads * head_dim)."""
        self.prompt.append((key.contiguous(), value.contiguous()))  # read every step: keep it dense
        attended = F.scaled_dot_product_attention(query, key, value, self.prompt_attend, enable_gqa=True)
        return attended.transpose(1, 2).flatten(2)

    def share_prefix(self, length: int) -> None:
        """speed.shared_prefix: the first `length` columns of every prompt are one common prefix, prefilled
        once (attend_prefix) before each prompt's rest (attend_rest); the decode steps are unchanged."""
        self.shared = []  # per layer, the prefix's (1, kv, length, head_dim) key and value
        rest = self.prompt_attend[:, :, length:]  # (B, 1, P - length, P): the rest's queries, every key
        self.rest_attend = rest.clone()
        self.rest_attend[..., :length] = True  # the prefix is all real, and before every query of the rest

    def attend_prefix(self, layer, query, key, value):
        """Prefill of the shared prefix, one sequence: query (1, heads, C, head_dim) -> (1, C, heads * head_dim)."""
        self.shared.append((key, value))
        attended = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
        return attended.transpose(1, 2).flatten(2)

    def attend_rest(self, layer, query, key, value):
        """Prefill of each prompt after the prefix: query (B, heads, P - C, head_dim) against the prefix's
        keys and its own -> (B, P - C, heads * head_dim); the cache keeps [prefix, own] per prompt."""
        shared_key, shared_value = self.shared[layer]
        prompts = key.shape[0]
        key = torch.cat([shared_key.expand(prompts, -1, -1, -1), key], dim=2)  # (B, kv, P, head_dim)
        value = torch.cat([shared_value.expand(prompts, -1, -1, -1), value], dim=2)
        self.prompt.append((key, value))  # fresh from cat: dense
        attended = F.scaled_dot_product_attention(query, key, value, self.rest_attend, enable_gqa=True)
        return attended.transpose(1, 2).flatten(2)

    def attend_step(self, layer, query, key, value):
        """Decode: query (N, heads, 1, head_dim), key/value (N, kv, 1, head_dim) -> (N, 1, heads * head_dim)."""
        own_keys, own_values = self.own[layer]
        own_keys[:, :, self.length] = key[:, :, 0]
        own_values[:, :, self.length] = value[:, :, 0]
        return self.attend_written(layer, query)

    def attend_written(self, layer, query):
        """attend_step with this step's key and value already in the cache at position `length` (the fused
        decode step's rope writes them there): query (N, heads, 1, head_dim) -> (N, 1, heads * head_dim)."""
        own_keys, own_values = self.own[layer]
        prompt_keys, prompt_values = self.prompt[layer]
        if self.fused:
            attended = decode_attention.attend(query, self.engine.scale, prompt_keys, prompt_values, self.bias_rows,
                                               self.prompt_of_row, own_keys, own_values, self.length + 1)
            if attended is not None:
                return attended
        own_keys, own_values = own_keys[:, :, : self.length + 1], own_values[:, :, : self.length + 1]
        rows, head_dim, kv_heads = query.shape[0], query.shape[3], own_keys.shape[1]
        prompts, generations, width = self.num_prompts, self.num_generations, self.prompt_width
        # The heads sharing a KV head become that head's queries, so K/V are never repeated.
        query = query.reshape(rows, kv_heads, -1, head_dim) * self.engine.scale  # (N, kv, group, head_dim)
        group = query.shape[2]
        grid = self._to_grid(query).view(prompts, generations, kv_heads, group, head_dim)
        grid = grid.transpose(1, 2).reshape(prompts, kv_heads, generations * group, head_dim)
        prompt_scores = torch.matmul(grid, prompt_keys.transpose(-1, -2)) + self.prompt_bias  # (B, kv, G*group, P)
        prompt_scores = prompt_scores.view(prompts, kv_heads, generations, group, width).transpose(1, 2)
        prompt_scores = self._from_grid(prompt_scores.reshape(-1, kv_heads, group, width))  # (N, kv, group, P)
        own_scores = torch.matmul(query, own_keys.transpose(-1, -2))  # (N, kv, group, length)
        probs = torch.softmax(torch.cat([prompt_scores, own_scores], dim=-1), dim=-1)
        prompt_probs = self._to_grid(probs[..., :width]).view(prompts, generations, kv_heads, group, width)
        prompt_probs = prompt_probs.transpose(1, 2).reshape(prompts, kv_heads, generations * group, width)
        from_prompt = torch.matmul(prompt_probs, prompt_values).view(prompts, kv_heads, generations, group, head_dim)
        from_prompt = self._from_grid(from_prompt.transpose(1, 2).reshape(-1, kv_heads, group, head_dim))
        attended = from_prompt + torch.matmul(probs[..., width:], own_values)  # (N, kv, group, head_dim)
        return attended.reshape(rows, 1, -1)

    def keep(self, keep: torch.Tensor) -> None:
        """Drop finished rows: keep (live_after,) batch indices, ascending."""
        self.own = [(take_rows(keys, keep, self.length), take_rows(values, keep, self.length))
                    for keys, values in self.own]
        self.rows = keep if self.rows is None else self.rows[keep]
        self.prompt_of_row = self.prompt_of_row[keep]

    def _to_grid(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return x
        return x.new_zeros((self.num_prompts * self.num_generations,) + x.shape[1:]).index_copy_(0, self.rows, x)

    def _from_grid(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.rows is None else x.index_select(0, self.rows)


def take_rows(cache: torch.Tensor, keep: torch.Tensor, stop: int, zero: bool = False) -> torch.Tensor:
    """cache[keep] along dim 0, copying only the slots written so far (..stop); the rest uninitialized, or
    zeros with `zero` (RaggedCache, whose rows read up to their own lengths)."""
    taken = (cache.new_zeros if zero else cache.new_empty)((len(keep),) + cache.shape[1:])
    taken[:, :, :stop] = cache[:, :, :stop].index_select(0, keep)
    return taken
