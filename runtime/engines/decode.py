"""The embedded engine's decode loop: a static KV cache, one CUDA graph per call on the GPU, sampling as it goes.

transformers' ``generate`` costs about 100 ms of Python and kernel launches per decoding step at a Qwen3-0.6B shape
(64 x 512 tokens took 58 s on an H100 against a 0.67 s memory floor). This loop runs the same HF model's modules:

- **prefill** once, eagerly, into a :class:`transformers.StaticCache` sized ``prompt + max_new_tokens``;
- **decode** one token per step for every row, with the step's inputs (last tokens, positions, the key mask) in
  fixed buffers, so that on CUDA the whole model forward is captured once as a CUDA graph and replayed each step;
- **attention** through :func:`static_cache_attention`, registered with transformers' attention interface: for one
  query per row it reads each key/value head once for its whole query group (no ``repeat_kv`` copies of the cache);
- **sampling** by :func:`sample_tokens`, whose log-prob of the drawn token is the untruncated
  ``log_softmax(logits / T)``: memory is O(B x V) per step, never O(B x T x V).

Left padding keeps every row's next cache slot the same, so one write index serves the batch; a row's rotary
position is its own token count. Rows that have stopped are fed padding until every row has stopped (checked every
``check_every`` steps, to keep the GPU queue full) or the call is aborted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ATTENTION = "rlcore_static"


def static_cache_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature. query ``[B, H, q, D]``, key/value ``[B, Hkv, k, D]``, mask bool
    ``[B, 1, q, k]`` (True attends) or None (causal); returns ``[B, q, H, D]``.

    With one query per row the ``H / Hkv`` query heads of a group become that group's query rows, so the cache is
    read once per key/value head; otherwise key/value heads are repeated, as transformers' SDPA path does.
    """
    b, h, q, d = query.shape
    hkv = key.shape[1]
    groups = h // hkv
    if q == 1 and attention_mask is not None:
        out = torch.nn.functional.scaled_dot_product_attention(
            query.reshape(b, hkv, groups, d), key, value, attn_mask=attention_mask, dropout_p=0.0, scale=scaling
        )
        return out.reshape(b, h, 1, d).transpose(1, 2), None
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, is_causal=attention_mask is None and q > 1, scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Make :func:`static_cache_attention` selectable as ``attn_implementation="rlcore_static"``."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, static_cache_attention)


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    nucleus: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Draw one token per row. logits ``[B, V]`` -> tokens ``[B]`` int64, log-probs ``[B]`` float32, and with
    ``nucleus`` the kept set ``[B, V]`` bool (else None).

    The draw is from ``softmax(logits / temperature)`` kept to the ``top_k`` largest (``-1``: all; ties with the
    k-th are kept), then to the smallest prefix by probability whose mass before a token is at most ``top_p``
    (SGLang's rule; the most likely token is always kept), renormalised. The log-prob is the *untruncated*
    ``log_softmax(logits.float() / temperature)`` at the drawn token: the trainer's arithmetic.
    The draw is ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d., an exact sample from ``p``.

    ``nucleus`` (top-p nucleus replay, ``--rollout-top-p-replay``): the kept set is what top-k and top-p left (the
    drawn token is always in it), and the log-prob is the drawn token's under the distribution it was drawn from,
    ``softmax`` over the kept set (:func:`rlcore.kernels.nucleus_log_probs`, which the trainer replays).
    """
    scaled = logits.float() * (1.0 / temperature)
    log_probs = torch.log_softmax(scaled, dim=-1)
    kept = scaled
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        kept = kept.masked_fill(kept < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = kept.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs
        ordered = ordered.masked_fill(before > top_p, float("-inf"))
        kept = torch.empty_like(kept).scatter_(-1, order, ordered)
    probs = kept.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    tokens = (probs / noise).argmax(dim=-1)
    if not nucleus:
        return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1), None
    keep = kept > float("-inf")
    keep[torch.arange(len(tokens), device=keep.device), tokens] = True
    renormalised = torch.log_softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    return tokens, renormalised.gather(-1, tokens[:, None]).squeeze(-1), keep


@dataclass(frozen=True)
class Decoded:
    """``tokens`` / ``log_probs``: ``[B, steps]`` (a row's columns after its stop token are padding); ``nucleus``
    (when asked for): ``nucleus[b][step]`` the ids row ``b`` drew its token at ``step`` from, ascending."""

    tokens: torch.Tensor
    log_probs: torch.Tensor
    nucleus: list[list[list[int]]] | None = None


def _reset_write_index(cache, position: int) -> None:
    for layer in cache.layers:
        layer.cumulative_length.fill_(position)


@torch.no_grad()
def decode(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    stop_ids: list[int],
    pad_id: int,
    is_aborted: Callable[[], bool] = lambda: False,
    min_new_tokens: int = 0,
    stopped: Callable[[torch.Tensor], torch.Tensor] | None = None,
    cuda_graph: bool | None = None,
    compile: bool = False,
    check_every: int = 8,
    nucleus: bool = False,
) -> Decoded:
    """Sample up to ``max_new_tokens`` per row of a left-padded batch.

    input_ids, attention_mask: ``[B, P]`` on the model's device (mask 1 for prompt tokens, 0 for left padding).
    ``cuda_graph`` (default: on CUDA) replays the decode step's forward as one CUDA graph; ``compile`` runs that
    forward through ``torch.compile`` first (fused elementwise kernels; compiled once per batch size and cache
    length, which is rounded up to a multiple of 128 so that calls share it). ``is_aborted`` is read after every
    step; once true the call returns what was sampled so far. Before ``min_new_tokens`` tokens a row cannot draw a
    stop id (its logits are -inf there, as transformers' min-new-tokens processor does; the log-probs are then of
    that constrained distribution). ``stopped`` (every ``check_every`` steps, given the ``[B, steps]`` tokens so far)
    marks rows as stopped for a reason of the caller's, such as a stop string; it only ends them early.
    ``nucleus``: report each step's kept set and renormalised log-probs (:func:`sample_tokens`).
    """
    from transformers import StaticCache

    device = input_ids.device
    if cuda_graph is None:
        cuda_graph = device.type == "cuda"
    batch, prompt_len = input_ids.shape
    total = prompt_len + max_new_tokens
    if compile:
        total = -(-total // 128) * 128
    cache = StaticCache(config=model.config, max_cache_len=total)
    real = attention_mask.bool()
    # keys[b, j]: cache slot j holds a real token of row b (prompt tokens, then every decoded slot).
    keys = torch.zeros(batch, total, dtype=torch.bool, device=device)
    keys[:, :prompt_len] = real
    lengths = real.sum(-1)
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones(prompt_len, total, dtype=torch.bool, device=device).tril()
    # Padding queries attend to themselves, so that their cached keys/values stay finite.
    itself = torch.eye(prompt_len, total, dtype=torch.bool, device=device)
    prefill_mask = (causal[None] & keys[:, None, :]) | itself[None]
    logits = model(
        input_ids=input_ids,
        attention_mask=prefill_mask[:, None],
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]

    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    out_tokens = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
    out_log_probs = torch.zeros(batch, max_new_tokens, dtype=torch.float32, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    token_in = torch.empty(batch, 1, dtype=torch.long, device=device)
    position_in = torch.empty(batch, 1, dtype=torch.long, device=device)
    step_mask = keys[:, None, None, :]

    step_model = _compiled(model) if compile else model

    def forward() -> torch.Tensor:
        return step_model(
            input_ids=token_in,
            attention_mask=step_mask,
            position_ids=position_in,
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1]

    graph = graph_logits = None
    steps = 0
    kept_ids: list[torch.Tensor] = []  # per step, [n, 2] (row, token id) pairs of the kept sets
    for step in range(max_new_tokens):
        if step < min_new_tokens:
            logits = logits.index_fill(-1, stop, float("-inf"))
        tokens, log_probs, keep = sample_tokens(
            logits, temperature=temperature, top_k=top_k, top_p=top_p, nucleus=nucleus
        )
        if keep is not None:
            kept_ids.append((keep & ~done[:, None]).nonzero().cpu())
        tokens = tokens.masked_fill(done, pad_id)
        out_tokens[:, step] = tokens
        out_log_probs[:, step] = log_probs.masked_fill(done, 0.0)
        done |= torch.isin(tokens, stop)
        steps = step + 1
        if steps == max_new_tokens or is_aborted():
            break
        if steps % check_every == 0:
            if stopped is not None:
                done |= stopped(out_tokens[:, :steps]).to(device)
            if bool(done.all()):
                break
        # Feed the token just drawn: cache slot prompt_len + step, rotary position lengths + step.
        token_in.copy_(tokens[:, None])
        position_in.copy_((lengths + step)[:, None])
        keys[:, prompt_len + step] = True
        if not cuda_graph:
            logits = forward()
            continue
        if graph is None:
            graph, graph_logits = _capture(forward, cache, write_index=prompt_len + step)
        graph.replay()
        logits = graph_logits
    return Decoded(
        tokens=out_tokens[:, :steps],
        log_probs=out_log_probs[:, :steps],
        nucleus=_per_row(kept_ids, batch) if nucleus else None,
    )


def _per_row(kept_ids: list[torch.Tensor], batch: int) -> list[list[list[int]]]:
    """``[B][steps][ids]`` from each step's ``(row, id)`` pairs (``nonzero`` order: by row, ids ascending)."""
    out: list[list[list[int]]] = [[] for _ in range(batch)]
    for pairs in kept_ids:
        counts = torch.bincount(pairs[:, 0], minlength=batch).tolist()
        for row, ids in enumerate(torch.split(pairs[:, 1], counts)):
            out[row].append(ids.tolist())
    return out


def _compiled(model: torch.nn.Module):
    """``torch.compile(model)``, made once per model and kept on it."""
    compiled = getattr(model, "_rlcore_compiled", None)
    if compiled is None:
        compiled = torch.compile(model, dynamic=False)
        model._rlcore_compiled = compiled
    return compiled


def _capture(forward: Callable[[], torch.Tensor], cache, *, write_index: int):
    """Warm ``forward`` up on a side stream, rewind the cache's write index, and capture it as a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    # The warm-up wrote this step's keys/values and moved the write index on; the replay writes them again.
    _reset_write_index(cache, write_index)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = forward()
    return graph, logits
