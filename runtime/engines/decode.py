"""The embedded engine's decode loop: a static KV cache of slots, one CUDA graph per call on the GPU, sampling as it
goes, finished rows refilled with waiting prompts.

transformers' ``generate`` costs about 100 ms of Python and kernel launches per decoding step at a Qwen3-0.6B shape
(64 x 512 tokens took 58 s on an H100 against a 0.67 s memory floor). This loop runs the same HF model's modules:

- **prefill** eagerly into a slot cache (:func:`slot_cache`): ``slots`` rows of ``prompt width + max_new_tokens``
  key/value columns (a prompt left-padded to the call's widest in columns ``[0, width)``, its ``k``-th new token in
  column ``width + k``, whichever slot it runs in);
- **decode** one token per step for every slot, with the step's inputs (last tokens, positions, per-row write
  columns, the key mask) in fixed buffers, so that on CUDA the whole model forward is captured once as a CUDA graph
  and replayed each step;
- **attention** through :func:`static_cache_attention`, registered with transformers' attention interface: for one
  query per row it reads each key/value head once for its whole query group (no ``repeat_kv`` copies of the cache);
- **sampling** by :func:`sample_tokens`, whose log-prob of the drawn token is the untruncated
  ``log_softmax(logits / T)``: memory is O(slots x V) per step, never O(B x T x V).

**Continuous refill** (``max_running``): with fewer slots than prompts, every ``check_every`` steps (one host sync,
so that the GPU queue stays full between checks) the rows that have stopped hand their responses back and their
slots are prefilled with the next waiting prompts, so that short responses do not leave the batch idle while long
ones finish. A stopped row idles (its draws are not kept) until that check.

**Per-prompt streams.** Prompt ``i`` draws its ``k``-th token by inverse CDF (:func:`inverse_cdf`) from the ``k``-th
uniform of its own generator, seeded with ``seeds[i]`` (:func:`prompt_uniforms`). A prompt's draws therefore do not
depend on which slot it runs in, on what runs beside it or on refill, only on the logits it is drawn from. In float32
on the CPU a prompt gives the same tokens with any ``max_running``, and log-probs equal to float32 rounding (tested:
MKL rounds a matmul of fewer than about 9 rows differently, so smaller batches may differ in the last bit). On a GPU
in bf16 the matmuls may round differently for another batch shape, and a near-flat distribution turns such a
difference into another draw; every draw is still an exact sample of the logits it was made from.

**Top-p replay** (``nucleus``): each step's kept sets stay on the device until the next check, where they are read
back with the check's own sync and appended to the lists of the prompts their slots ran, so a refilled slot's
nuclei belong to the prompt that drew them and a CUDA-graph step adds no host sync.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Sequence
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
    uniforms: torch.Tensor | None = None,
    nucleus: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Draw one token per row. logits ``[B, V]`` -> tokens ``[B]`` int64, log-probs ``[B]`` float32, and with
    ``nucleus`` the kept set ``[B, V]`` bool (else None).

    The draw is from ``softmax(logits / temperature)`` kept to the ``top_k`` largest (``-1``: all; ties with the
    k-th are kept), then to the smallest prefix by probability whose mass before a token is at most ``top_p``
    (SGLang's rule; the most likely token is always kept; ties in a stable order), renormalised. The log-prob is the
    *untruncated* ``log_softmax(logits.float() / temperature)`` at the drawn token: the trainer's arithmetic.
    Row ``b`` is drawn by :func:`inverse_cdf` from ``uniforms[b]`` (``[B]`` in ``[0, 1)``; default: drawn from
    ``generator``), so that a row's token depends on its own logits and uniform only.

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
        ordered, order = kept.sort(dim=-1, descending=True, stable=True)
        probs = ordered.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs
        ordered = ordered.masked_fill(before > top_p, float("-inf"))
        kept = torch.empty_like(kept).scatter_(-1, order, ordered)
    if uniforms is None:
        uniforms = torch.rand(scaled.shape[0], generator=generator, device=scaled.device)
    tokens = inverse_cdf(kept.softmax(dim=-1), uniforms)
    if not nucleus:
        return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1), None
    keep = kept > float("-inf")
    keep[torch.arange(len(tokens), device=keep.device), tokens] = True
    renormalised = torch.log_softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    return tokens, renormalised.gather(-1, tokens[:, None]).squeeze(-1), keep


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The first token of each row whose cumulative probability exceeds ``uniforms`` times the row's total.
    probs ``[B, V]`` (>= 0, rows need not sum to 1), uniforms ``[B]`` in ``[0, 1)`` -> ``[B]`` int64.

    Only tokens of positive probability are candidates, and the target stays below the largest of their cumulative
    sums, so a truncated token (probability 0) is never drawn even where a parallel scan's rounding makes the
    cumulative sum dip.
    """
    positive = probs > 0
    cdf = probs.cumsum(dim=-1).masked_fill(~positive, -1.0)
    total = cdf.max(dim=-1, keepdim=True).values
    target = torch.minimum(uniforms[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    return (cdf > target).int().argmax(dim=-1)


def prompt_uniforms(seeds: Sequence[int], steps: int) -> torch.Tensor:
    """``[len(seeds), steps]`` float32 uniforms in ``[0, 1)`` on the CPU: row ``i`` is the first ``steps`` draws of
    a generator seeded with ``seeds[i]`` (each prompt's own stream, whatever runs beside it)."""
    out = torch.empty(len(seeds), steps, dtype=torch.float32)
    for row, seed in zip(out, seeds, strict=True):
        torch.rand(steps, generator=torch.Generator().manual_seed(int(seed)), out=row)
    return out


def slot_cache(config, *, slots: int, max_cache_len: int, device: torch.device):
    """A KV cache of ``slots`` rows that each hold one prompt at a time, for a model of ``config`` (a transformers
    ``Cache`` whose layers are static layers written per row; ``kept_tensors()`` lists what it holds).

    Its ``prefill_rows`` (``[k]`` slot indices, or None in decode) and ``write_pos`` (``[slots]``, the column each
    row's next key goes to) say where the model's next forward writes.
    """
    layers = config.get_text_config(decoder=True).num_hidden_layers
    return _slot_cache_class()(layers=layers, slots=slots, max_cache_len=max_cache_len, device=device)


@functools.cache
def _slot_cache_class():
    from transformers.cache_utils import Cache, StaticLayer
    from transformers.utils import is_torchdynamo_compiling

    class SlotLayer(StaticLayer):
        """Keys and values ``[slots, Hkv, max_cache_len, D]``; :meth:`update` writes where its cache says."""

        def __init__(self, *, slots: int, max_cache_len: int, where: Cache):
            super().__init__(max_cache_len=max_cache_len)
            self.slots, self.where = slots, where

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.batch_size, self.num_heads = self.slots, key_states.shape[1]
            self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
            shape = (self.slots, self.num_heads, self.max_cache_len)
            self.keys = torch.zeros(*shape, self.k_head_dim, dtype=self.dtype, device=self.device)
            self.values = torch.zeros(*shape, self.v_head_dim, dtype=self.dtype, device=self.device)
            if not is_torchdynamo_compiling():
                torch._dynamo.mark_static_address(self.keys)
                torch._dynamo.mark_static_address(self.values)
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            """Prefill (``prefill_rows`` set): write ``[k, Hkv, width, D]`` into columns ``[0, width)`` of those
            rows and attend over them alone. Decode: write ``[slots, Hkv, 1, D]`` into each row's column
            ``write_pos`` and attend over the whole cache."""
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            rows = self.where.prefill_rows
            if rows is not None:
                width = key_states.shape[2]
                self.keys[rows, :, :width] = key_states
                self.values[rows, :, :width] = value_states
                return key_states, value_states
            self.keys[self.where.slot_index, :, self.where.write_pos] = key_states[:, :, 0]
            self.values[self.where.slot_index, :, self.where.write_pos] = value_states[:, :, 0]
            return self.keys, self.values

    class SlotCache(Cache):
        def __init__(self, *, layers: int, slots: int, max_cache_len: int, device: torch.device):
            self.prefill_rows: torch.Tensor | None = None
            self.slot_index = torch.arange(slots, device=device)
            self.write_pos = torch.zeros(slots, dtype=torch.long, device=device)
            layer = {"slots": slots, "max_cache_len": max_cache_len, "where": self}
            super().__init__(layers=[SlotLayer(**layer) for _ in range(layers)])

        def kept_tensors(self) -> list[torch.Tensor]:
            """Every key/value tensor the cache holds (what its memory is)."""
            return [t for layer in self.layers if layer.is_initialized for t in (layer.keys, layer.values)]

    return SlotCache


@dataclass(frozen=True)
class Decoded:
    """Per prompt, in input order: ``tokens[i]`` / ``log_probs[i]`` (1-D CPU int64 / float32) of what prompt ``i``
    drew, up to and including its stop id; ``finish[i]``: ``"stop"`` (a stop id, or the caller's ``stopped``),
    ``"length"`` (``max_new_tokens``) or ``"abort"`` (cut short, or never started); ``steps``: decoding steps run;
    ``nucleus`` (when asked for): ``nucleus[i][k]`` the ids prompt ``i`` drew its ``k``-th token from, ascending."""

    tokens: list[torch.Tensor]
    log_probs: list[torch.Tensor]
    finish: list[str]
    steps: int
    nucleus: list[list[list[int]]] | None = None


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
    seeds: Sequence[int] | None = None,
    max_running: int | None = None,
    is_aborted: Callable[[], bool] = lambda: False,
    min_new_tokens: int = 0,
    stopped: Callable[[list[list[int]]], list[bool]] | None = None,
    cuda_graph: bool | None = None,
    compile: bool = False,
    check_every: int = 8,
    on_cache: Callable[[object], None] | None = None,
    nucleus: bool = False,
) -> Decoded:
    """Sample up to ``max_new_tokens`` for each row of a left-padded batch of prompts.

    input_ids, attention_mask: ``[B, P]`` on the model's device (mask 1 for prompt tokens, 0 for left padding).
    ``seeds`` (``B`` ints; default: drawn from torch's generator) seed each prompt's stream of draws.
    ``max_running`` (default ``B``) is the number of slots: prompts beyond it wait and take the slot of a row that
    has stopped, at the next check (every ``check_every`` steps). ``cuda_graph`` (default: on CUDA) replays the decode
    step's forward as one CUDA graph; ``compile`` runs that forward through ``torch.compile`` first (fused elementwise
    kernels; compiled once per slot count and cache length, which is rounded up to a multiple of 128 so that calls
    share it). ``is_aborted`` is read after every step; once true the call returns what was sampled so far. Before
    ``min_new_tokens`` tokens a row cannot draw a stop id (its logits are -inf there, as transformers'
    min-new-tokens processor does; the log-probs are then of that constrained distribution). ``stopped`` (at each
    check, given the token lists of the rows still running) marks rows as stopped for a reason of the caller's, such
    as a stop string; it only ends them early. ``on_cache`` is shown the cache once it is built (tests measure it).
    ``nucleus``: report each draw's kept set (:func:`sample_tokens`) and its log-prob renormalised over it; the sets
    of the steps since the last check are kept on the device and read back at the check, with no sync of their own.
    """
    device = input_ids.device
    if cuda_graph is None:
        cuda_graph = device.type == "cuda"
    batch, width = input_ids.shape
    slots = batch if max_running is None else max(1, min(max_running, batch))
    total = width + max_new_tokens
    if compile:
        total = -(-total // 128) * 128
    if seeds is None:
        seeds = torch.randint(0, 2**62, (batch,)).tolist()
    if len(seeds) != batch:
        raise ValueError(f"seeds: one per prompt, got {len(seeds)} for {batch} prompts")
    all_uniforms = prompt_uniforms(seeds, max_new_tokens)
    cache = slot_cache(model.config, slots=slots, max_cache_len=total, device=device)
    if on_cache is not None:
        on_cache(cache)
    real = attention_mask.bool()
    all_lengths = real.sum(-1)
    all_positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    # Padding queries attend to themselves, so that their cached keys/values stay finite.
    itself = torch.eye(width, dtype=torch.bool, device=device)

    # Per slot: keys[s, j] (column j holds a real token of the slot's prompt or response), the prompt's length,
    # tokens drawn so far, whether it has stopped, its uniforms, what it drew.
    keys = torch.zeros(slots, total, dtype=torch.bool, device=device)
    lengths = torch.zeros(slots, dtype=torch.long, device=device)
    count = torch.zeros(slots, dtype=torch.long, device=device)
    done = torch.zeros(slots, dtype=torch.bool, device=device)
    uniforms = torch.zeros(slots, max_new_tokens, dtype=torch.float32, device=device)
    out_tokens = torch.full((slots, max_new_tokens), pad_id, dtype=torch.long, device=device)
    out_log_probs = torch.zeros(slots, max_new_tokens, dtype=torch.float32, device=device)
    token_in = torch.zeros(slots, 1, dtype=torch.long, device=device)
    position_in = torch.zeros(slots, 1, dtype=torch.long, device=device)
    step_mask = keys[:, None, None, :]

    def prefill(rows: list[int], prompts: list[int]) -> torch.Tensor:
        """Start ``prompts`` in slots ``rows``; their first step's logits ``[k, V]``."""
        r = torch.tensor(rows, device=device)
        p = torch.tensor(prompts, device=device)
        mask = real[p]
        keys[r] = False
        keys[r, :width] = mask
        lengths[r] = all_lengths[p]
        count[r] = 0
        done[r] = False
        uniforms[r] = all_uniforms[prompts].to(device)
        cache.prefill_rows = r
        try:
            return model(
                input_ids=input_ids[p],
                attention_mask=((causal[None] & mask[:, None, :]) | itself[None])[:, None],
                position_ids=all_positions[p],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
        finally:
            cache.prefill_rows = None

    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    stop_set = set(stop_ids)
    step_model = _compiled(model) if compile else model

    def forward() -> torch.Tensor:
        return step_model(
            input_ids=token_in,
            attention_mask=step_mask,
            position_ids=position_in,
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1]

    results: list[tuple[list[int], list[float], str, list[list[int]]] | None] = [None] * batch
    running: list[int | None] = list(range(slots))  # the prompt each slot runs
    waiting = deque(range(slots, batch))
    logits = prefill(list(range(slots)), list(range(slots)))
    is_stop_id = torch.zeros(logits.shape[-1], dtype=torch.bool, device=device)
    is_stop_id[stop[stop < logits.shape[-1]]] = True
    last_start = 0  # the step at which the latest prompts started: every row has stopped max_new_tokens later
    graph = graph_logits = None
    last = max_new_tokens - 1
    # Top-p replay: each live row's kept set per step since the last check ([slots, V] bool on the device), and per
    # slot the nuclei of the prompt it runs, one per token drawn (read back at each check, the host sync there is).
    block_keeps: list[torch.Tensor] = []
    slot_nuclei: list[list[list[int]]] = [[] for _ in range(slots)]
    step = 0
    while True:
        if min_new_tokens:
            logits = logits.masked_fill(is_stop_id[None] & (count < min_new_tokens)[:, None], float("-inf"))
        column = count.clamp(max=last)[:, None]
        tokens, log_probs, keep = sample_tokens(
            logits,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            uniforms=uniforms.gather(1, column)[:, 0],
            nucleus=nucleus,
        )
        live = ~done
        if keep is not None:
            block_keeps.append(keep & live[:, None])
        out_tokens.scatter_(1, column, torch.where(live, tokens, out_tokens.gather(1, column)[:, 0])[:, None])
        out_log_probs.scatter_(1, column, torch.where(live, log_probs, out_log_probs.gather(1, column)[:, 0])[:, None])
        count += live
        done |= live & (torch.isin(tokens, stop) | (count > last))
        step += 1
        aborted = is_aborted()
        fresh: list[tuple[int, int]] = []
        if aborted or step % check_every == 0 or step - last_start == max_new_tokens:
            state = torch.stack([done.long(), count]).cpu()
            stopped_now, counts = state[0].bool().tolist(), state[1].tolist()
            rows_out = out_tokens.cpu()
            if block_keeps:
                _take_nuclei(block_keeps, slot_nuclei)
                block_keeps = []
            if stopped is not None:
                going = [s for s in range(slots) if running[s] is not None and not stopped_now[s]]
                flags = stopped([rows_out[s, : counts[s]].tolist() for s in going]) if going else []
                for s, flag in zip(going, flags, strict=True):
                    stopped_now[s] = stopped_now[s] or bool(flag)
            lps_out = out_log_probs.cpu()
            for s, prompt in enumerate(running):
                if prompt is None or not (stopped_now[s] or aborted):
                    continue
                drawn = rows_out[s, : counts[s]].tolist()
                if drawn and drawn[-1] in stop_set:
                    reason = "stop"
                elif stopped_now[s]:  # the caller's stop, or the length limit
                    reason = "length" if counts[s] == max_new_tokens else "stop"
                else:
                    reason = "abort"
                results[prompt] = (drawn, lps_out[s, : counts[s]].tolist(), reason, slot_nuclei[s][: counts[s]])
                slot_nuclei[s] = []
                running[s] = None
            if aborted:
                break
            done.copy_(torch.tensor(stopped_now, device=device))
            while waiting and None in running:
                s = running.index(None)
                running[s] = waiting.popleft()
                fresh.append((s, running[s]))
            if all(prompt is None for prompt in running):
                break
        # Feed the token just drawn: rotary position = the row's token count, cache column width + its index.
        token_in.copy_(tokens[:, None])
        position_in.copy_((lengths + count - 1)[:, None])
        cache.write_pos.copy_(width + count - 1)
        keys[cache.slot_index, cache.write_pos] = True
        if not cuda_graph:
            logits = forward()
        else:
            if graph is None:
                graph, graph_logits = _capture(forward)
            graph.replay()
            logits = graph_logits
        if fresh:
            # After the step's forward: the freed slots' last writes land before their new prompts' prefill.
            rows, prompts = zip(*fresh, strict=True)
            logits = logits.index_copy(0, torch.tensor(rows, device=device), prefill(list(rows), list(prompts)))
            last_start = step
    for i in waiting:
        results[i] = ([], [], "abort", [])
    empty_lps = torch.zeros(0, dtype=torch.float32)
    return Decoded(
        tokens=[torch.tensor(r[0], dtype=torch.long) for r in results],
        log_probs=[torch.tensor(r[1], dtype=torch.float32) if r[1] else empty_lps for r in results],
        finish=[r[2] for r in results],
        steps=step,
        nucleus=[r[3] for r in results] if nucleus else None,
    )


def _take_nuclei(keeps: list[torch.Tensor], slot_nuclei: list[list[list[int]]]) -> None:
    """Append each step's kept ids to its slot's list. keeps: per step ``[slots, V]`` bool, all False for a row
    that did not draw at that step (a live row's set holds at least its drawn token). One copy to the host."""
    stacked = torch.stack(keeps, dim=1)  # [slots, steps, V]
    slots, steps = stacked.shape[:2]
    pairs = stacked.nonzero().cpu()  # (slot, step, id), ordered: by slot, then step, then id
    counts = torch.bincount(pairs[:, 0] * steps + pairs[:, 1], minlength=slots * steps).tolist()
    for at, ids in enumerate(torch.split(pairs[:, 2], counts)):
        if counts[at]:
            slot_nuclei[at // steps].append(ids.tolist())


def _compiled(model: torch.nn.Module):
    """``torch.compile(model)``, made once per model and kept on it."""
    compiled = getattr(model, "_rlcore_compiled", None)
    if compiled is None:
        compiled = torch.compile(model, dynamic=False)
        model._rlcore_compiled = compiled
    return compiled


def _capture(forward: Callable[[], torch.Tensor]):
    """Warm ``forward`` up on a side stream and capture it as a CUDA graph. The warm-up writes this step's keys and
    values at the same cache columns as the replay does, so nothing needs rewinding."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = forward()
    return graph, logits
