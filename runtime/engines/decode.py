"""The embedded engine's decode loop: a KV cache that keeps each prompt once for its group of samples, the whole
decoding step (forward and sampling) replayed as CUDA graphs on the GPU, finished groups refilled with waiting
prompts.

transformers' ``generate`` costs about 100 ms of Python and kernel launches per decoding step at a Qwen3-0.6B shape
(64 x 512 tokens took 58 s on an H100 against a 0.67 s memory floor). This loop runs the same HF model's modules:

- **shared prompts**: a call's rows that come in equal runs of the same prompt (a GRPO group's samples, as the
  rollout sends them) are one *group*: the prompt is prefilled once, its keys and values kept once
  (:class:`DecodeCache`), and every sample of the group draws its first token from the same logits with its own
  uniforms. ``share_prompts=False`` (or rows that are not such runs) makes every row a group of one.
- **the cache** (:class:`DecodeCache`): per layer, the group's prompt keys/values (left-padded to the call's widest
  prompt) and each sample's response keys/values (its ``k``-th new token in column ``k``), in ``max_running`` rows;
- **decode** one token per step for every row, with the step's inputs (last tokens, positions, write columns) in
  fixed buffers; on CUDA the model forward is one CUDA graph and the sampling and bookkeeping another, so a step
  costs two graph replays and no host sync;
- **attention** (:func:`engine_attention`, registered with transformers' attention interface as ``rlcore_static``):
  prefill attends over the prompt with its mask; a decoding step attends over the group's prompt keys and the row's
  own response keys through :mod:`runtime.engines.decode_attention` (a Triton kernel on the GPU that reads only the
  real columns, each prompt once per group and each key/value head once per query group; plain torch on the CPU);
- **sampling** by :func:`sample_tokens`, whose log-prob of the drawn token is the untruncated
  ``log_softmax(logits / T)``: memory is O(rows x V) per step, never O(B x T x V).

**Continuous refill** (``max_running``): with fewer rows than prompts, every ``check_every`` steps the rows that
have stopped hand their responses back, and a group whose samples have all stopped is prefilled with the next waiting
prompt's group, so that short responses do not leave the batch idle while long ones finish. A stopped row idles (its
draws are not kept) until then. On the GPU a check reads the rows' state as the previous check left it, copied back
on a side stream (``lagged_checks``), so the host never waits for the GPU's queue to drain: the GPU runs the next
block while the host decides, and only the rows that hand their responses back are copied to the host.

**Per-prompt streams.** Prompt ``i`` draws its ``k``-th token by inverse CDF (:func:`inverse_cdf`) from the ``k``-th
uniform of its own generator, seeded with ``seeds[i]`` (:func:`prompt_uniforms`). A prompt's draws therefore do not
depend on which row it runs in, on what runs beside it or on refill, only on the logits it is drawn from. In float32
on the CPU a prompt gives the same tokens with any ``max_running``, and log-probs equal to float32 rounding (tested:
MKL rounds a matmul of fewer than about 9 rows differently, so smaller batches may differ in the last bit). On a GPU
in bf16 the matmuls may round differently for another batch shape, and a near-flat distribution turns such a
difference into another draw; every draw is still an exact sample of the logits it was made from.

**Top-p replay** (``nucleus``): each step's kept sets stay on the device until the next check, where they are read
back with the check's own sync and appended to the lists of the prompts their rows ran, so a refilled row's nuclei
belong to the prompt that drew them and a step adds no host sync.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from runtime.engines.decode_attention import DECODE_ATTENTION, PAGE_SIZE, STORE_DECODE_KV, default_kernel
from runtime.engines.routes import RouteRecorder, install_route_hooks
from runtime.engines.sampling import plain_sample_triton

ATTENTION = "rlcore_static"
CACHE_KWARG = "rlcore_cache"  # the model call's keyword that carries the DecodeCache down to engine_attention
# engine_attention's keyword that says the step's keys and values are in the cache already (the fused rotary kernel
# wrote them, runtime.engines.fused)
STORED_KWARG = "rlcore_kv_stored"


def engine_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature. query ``[B, H, q, Dk]``, key/value ``[B, Hkv, k, Dk/Dv]``, mask bool
    ``[B, 1, q, k]`` (True attends) or None (causal); returns ``[B, q, H, Dv]`` (sized by the value head dim, which
    MLA models make differ from the query/key one).

    Called with a :class:`DecodeCache` under ``kwargs[CACHE_KWARG]`` (the engine's decode loop), it stores the keys
    and values in the cache and attends through it (:meth:`DecodeCache.attend`); otherwise it is masked attention
    over ``key`` and ``value`` (:func:`masked_attention`).
    """
    cache = kwargs.get(CACHE_KWARG)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if cache is not None:
        stored = kwargs.get(STORED_KWARG, False)
        return cache.attend(module.layer_idx, query, key, value, attention_mask, scale=scale, stored=stored), None
    return masked_attention(query, key, value, attention_mask, scale=scale), None


def masked_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None, *, scale: float
) -> torch.Tensor:
    """SDPA over query ``[B, H, q, Dk]`` and key/value ``[B, Hkv, k, Dk/Dv]`` (key/value heads repeated for their
    query groups, as transformers' SDPA path does) -> ``[B, q, H, Dv]``."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, is_causal=attention_mask is None and query.shape[2] > 1,
        scale=scale,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous()


def register_attention() -> None:
    """Make :func:`engine_attention` selectable as ``attn_implementation="rlcore_static"``."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, engine_attention)


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    nucleus: bool = False,
    kernel: str = "torch",
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

    ``kernel`` (:data:`PLAIN_SAMPLERS`): with nothing to truncate and no kept set to report, ``triton`` draws in one
    Triton kernel (:mod:`runtime.engines.sampling`) what ``torch`` draws in about fifteen passes over the logits.
    With both top-k and top-p, the kept set comes from the ``k`` largest logits (:func:`top_p_after_top_k`), not
    from a sort of the vocabulary.
    """
    if kernel not in PLAIN_SAMPLERS:
        raise ValueError(f"kernel must be one of {sorted(PLAIN_SAMPLERS)}, got {kernel!r}")
    if uniforms is None:
        uniforms = torch.rand(logits.shape[0], generator=generator, device=logits.device)
    if not (0 < top_k < logits.shape[-1] or top_p < 1.0 or nucleus):
        return (*PLAIN_SAMPLERS[kernel](logits, uniforms, temperature=temperature), None)
    scaled = logits.float() * (1.0 / temperature)
    log_probs = torch.log_softmax(scaled, dim=-1)
    kept = scaled
    if 0 < top_k < scaled.shape[-1] and top_p < 1.0:
        kept = scaled.masked_fill(~top_p_after_top_k(scaled, top_k=top_k, top_p=top_p), float("-inf"))
    elif 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        kept = kept.masked_fill(kept < kth, float("-inf"))
    elif top_p < 1.0:
        ordered, order = kept.sort(dim=-1, descending=True, stable=True)
        probs = ordered.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs
        ordered = ordered.masked_fill(before > top_p, float("-inf"))
        kept = torch.empty_like(kept).scatter_(-1, order, ordered)
    tokens = inverse_cdf(kept.softmax(dim=-1), uniforms)
    if not nucleus:
        return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1), None
    keep = kept > float("-inf")
    keep[torch.arange(len(tokens), device=keep.device), tokens] = True
    renormalised = torch.log_softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    return tokens, renormalised.gather(-1, tokens[:, None]).squeeze(-1), keep


def top_p_after_top_k(scaled: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """The tokens :func:`sample_tokens` keeps under top-k then top-p, without sorting the vocabulary: scaled
    ``[B, V]`` float32 logits -> ``[B, V]`` bool.

    Top-k keeps the tokens at or above the k-th largest value ``kth``: those strictly above it (fewer than ``k``,
    all among ``torch.topk``'s ``k``) and a run of ``t`` tokens tied at ``kth``. In top-p's order (value descending,
    ties by token id) the strictly-above come first, sorted here among the ``k`` alone; the run follows, its
    ``r``-th token (by id) with ``S + r q`` of the kept mass before it (``S`` the mass strictly above, ``q`` one tied
    token's), kept while that is at most ``top_p``. So the sort is over ``k`` values, and the vocabulary is read only
    by elementwise passes and one running count of the tied tokens.
    """
    values, ids = torch.topk(scaled, top_k, dim=-1)
    kth = values[:, -1:]
    by_id, at = ids.sort(dim=-1)  # ties among the k in top-p's order: by token id, then a stable sort by value
    values, order = values.gather(-1, at).sort(dim=-1, descending=True, stable=True)
    ids = by_id.gather(-1, order)
    top = values[:, :1]
    above = values > kth
    tied = scaled == kth
    weight_above = torch.where(above, torch.exp(values - top), 0.0)
    weight_tied = torch.exp(kth - top)
    mass = weight_above.sum(-1, keepdim=True) + tied.sum(-1, keepdim=True) * weight_tied
    probs = weight_above / mass
    running = probs.cumsum(dim=-1)
    keep_above = above & (running - probs <= top_p)
    mass_above = running[:, -1:]
    one_tied = weight_tied / mass
    # The run keeps its r-th token while mass_above + r * one_tied <= top_p: r <= (top_p - mass_above) / one_tied.
    room = torch.where(one_tied > 0, (top_p - mass_above) / one_tied, float("inf"))
    tied_kept = torch.where(mass_above <= top_p, room.floor() + 1, 0.0)
    keep = torch.zeros_like(tied).scatter_(-1, ids, keep_above)
    return keep | (tied & (tied.cumsum(dim=-1) <= tied_kept))


def plain_sample_torch(
    logits: torch.Tensor, uniforms: torch.Tensor, *, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_tokens` with nothing truncated, in torch: logits ``[B, V]``, uniforms ``[B]`` -> tokens ``[B]``
    int64 and log-probs ``[B]`` float32."""
    scaled = logits.float() * (1.0 / temperature)
    tokens = inverse_cdf(scaled.softmax(dim=-1), uniforms)
    return tokens, torch.log_softmax(scaled, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


# sample_tokens' kernel -> how it draws when nothing is truncated
PLAIN_SAMPLERS = {"torch": plain_sample_torch, "triton": plain_sample_triton}


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


class DecodeCache:
    """The decode loop's paged KV cache for ``groups`` groups of ``per_group`` rows (row ``s`` is sample
    ``s % per_group`` of group ``s // per_group``), for a model of ``layers`` layers.

    Keys and values live in pages of ``page_size`` columns, per layer ``pool_k`` / ``pool_v``
    ``[pages, Hkv, page_size, Dk/Dv]`` (allocated at the first prefill, in the keys' own dtype and head dims), and
    the pages are handed out as the work needs them: a group's prompt takes the pages its real columns fall in, once
    for all its samples (``prefix_pages [groups, Pb]``: the prompt left-padded to ``width = Pb * page_size`` columns,
    real from ``prefix_start[g]``), and each row's response takes a page when it reaches it
    (``resp_pages [rows, Mb]``, ``Mb * page_size >= max_new_tokens``, real in ``[0, resp_len[s])``). Page 0 is
    scratch: every table entry that holds nothing points to it, so that a stopped row's idle writes land there. The
    tables live on the host (the decode loop hands pages out and takes them back at its checks, which already sync)
    and are copied to the device by :meth:`sync`. ``pages`` (default: enough for every row's longest response) bounds
    the pool; :meth:`assign_prompt` and :meth:`cover` report when it is short.

    In prefill the forward writes the ``prefill_rows`` groups' prompts; in decode each row's newest key/value goes to
    response column ``write_col`` (:meth:`set_step`). ``kernel`` names the decode attention
    (:data:`runtime.engines.decode_attention.DECODE_ATTENTION`).
    """

    def __init__(
        self,
        *,
        layers: int,
        groups: int,
        per_group: int,
        width: int,
        max_new_tokens: int,
        device: torch.device,
        kernel: str,
        page_size: int = 64,
        pages: int | None = None,
    ):
        if kernel not in DECODE_ATTENTION:
            raise ValueError(f"kernel must be one of {sorted(DECODE_ATTENTION)}, got {kernel!r}")
        if page_size < 16 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 16, got {page_size}")
        rows = groups * per_group
        self.groups, self.per_group, self.page_size = groups, per_group, page_size
        self.prompt_pages, self.response_pages = -(-width // page_size), -(-max_new_tokens // page_size)
        self.width, self.columns = self.prompt_pages * page_size, max_new_tokens
        self.pad = self.width - width  # the call's prompts sit this many columns right of where they came
        most = 1 + groups * self.prompt_pages + rows * self.response_pages
        self.pages = most if pages is None else pages
        if self.pages < 1 + self.prompt_pages + per_group * self.response_pages:
            raise ValueError(
                f"the KV cache needs at least {1 + self.prompt_pages + per_group * self.response_pages} pages of "
                f"{page_size} tokens (one group's prompt and longest responses), got {self.pages}"
            )
        self.attention, self.store = DECODE_ATTENTION[kernel], STORE_DECODE_KV[kernel]
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * layers
        self.prefill_rows: torch.Tensor | None = None
        self.free = list(range(self.pages - 1, 0, -1))  # taken from the end: low ids first
        # numpy, not torch: the checks touch single entries, which cost microseconds each as torch tensors (at
        # 256 rows of 16 pages that was 25 ms a check, 3 s of a 256x1024 call).
        self.host_prefix = np.zeros((groups, self.prompt_pages), dtype=np.int32)
        self.host_resp = np.zeros((rows, self.response_pages), dtype=np.int32)
        self.held = [0] * rows  # each row's response pages: the first held[s] entries of its table
        self.prefix_pages = torch.zeros(groups, self.prompt_pages, dtype=torch.long, device=device)
        self.resp_pages = torch.zeros(rows, self.response_pages, dtype=torch.long, device=device)
        self.prefix_start = torch.zeros(groups, dtype=torch.long, device=device)
        self.resp_len = torch.zeros(rows, dtype=torch.long, device=device)
        self.write_col = torch.zeros(rows, dtype=torch.long, device=device)
        self.write_page = torch.zeros(rows, dtype=torch.long, device=device)
        self.write_offset = torch.zeros(rows, dtype=torch.long, device=device)

    def kept_tensors(self) -> list[torch.Tensor]:
        """Every key/value tensor the cache holds (what its memory is)."""
        return [t for layer in self.layers if layer is not None for t in layer]

    def pages_in_use(self) -> int:
        """Pages handed out (the scratch page not counted)."""
        return self.pages - 1 - len(self.free)

    def assign_prompt(self, group: int, length: int) -> bool:
        """Give group row ``group`` the pages of a prompt of ``length`` tokens (its last ``length`` columns); False,
        changing nothing, when too few pages are free. The group's earlier prompt must have been released."""
        first = (self.width - length) // self.page_size
        count = self.prompt_pages - first
        if len(self.free) < count:
            return False
        self.host_prefix[group, first:] = self._take(count)
        return True

    def cover(self, row: int, columns: int) -> int:
        """Give row ``row`` pages for its first ``columns`` response columns (at most ``max_new_tokens``), as far
        as free pages go; returns how many more pages it would still need (0: covered)."""
        wanted, held = -(-min(columns, self.columns) // self.page_size), self.held[row]
        if wanted <= held:
            return 0
        count = min(wanted - held, len(self.free))
        self.host_resp[row, held : held + count] = self._take(count)
        self.held[row] = held + count
        return wanted - held - count

    def release_row(self, row: int) -> None:
        """Take back row ``row``'s response pages: its later (idle) writes go to the scratch page."""
        held = self.held[row]
        self.free.extend(self.host_resp[row, :held].tolist())
        self.host_resp[row, :held] = 0
        self.held[row] = 0

    def release_group(self, group: int) -> None:
        """Take back group row ``group``'s prompt pages."""
        self.free.extend(p for p in self.host_prefix[group].tolist() if p)
        self.host_prefix[group] = 0

    def sync(self) -> None:
        """Copy the host's page tables to the device (ordered on the stream, before the next forward)."""
        self.prefix_pages.copy_(torch.from_numpy(self.host_prefix))
        self.resp_pages.copy_(torch.from_numpy(self.host_resp))

    def _take(self, count: int) -> list[int]:
        taken = self.free[len(self.free) - count :]
        del self.free[len(self.free) - count :]
        return taken

    def set_step(self, newest: torch.Tensor) -> None:
        """A decoding step writes each row's newest key/value at response column ``newest`` ``[rows]`` and attends
        over its first ``newest + 1`` columns (device ops only: replayable in a CUDA graph)."""
        self.write_col.copy_(newest)
        self.resp_len.copy_(newest + 1)
        self.write_page.copy_(self.resp_pages.gather(1, (newest // self.page_size)[:, None])[:, 0])
        self.write_offset.copy_(newest % self.page_size)

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        scale: float,
        stored: bool = False,
    ) -> torch.Tensor:
        """Store this forward's keys and values for ``layer`` and attend. Prefill: key/value
        ``[k, Hkv, P, D]`` of the ``prefill_rows`` groups' prompts (``P`` the call's width), masked attention over
        them. Decode: key/value ``[rows, Hkv, 1, D]`` go to each row's page and offset (:meth:`set_step`; not with
        ``stored``, when the caller wrote them to :meth:`decode_target` already); each row's one query attends over
        its group's prompt and its own response. Returns ``[B, q, H, Dv]``."""
        if self.layers[layer] is None:
            self.layers[layer] = self._allocate(key, value)
        pool_k, pool_v = self.layers[layer]
        if self.prefill_rows is not None:
            pages = self.prefix_pages[self.prefill_rows]  # [k, Pb]
            for pool, new in ((pool_k, key), (pool_v, value)):
                paged = torch.nn.functional.pad(new, (0, 0, self.pad, 0)).unflatten(2, (-1, self.page_size))
                pool[pages] = paged.transpose(1, 2)  # [k, Pb, Hkv, S, D]; padding pages all go to the scratch one
            return masked_attention(query, key, value, attention_mask, scale=scale)
        if not stored:
            self.store(pool_k, pool_v, key[:, :, 0], value[:, :, 0], self.write_page, self.write_offset)
        out = self.attention(
            query[:, :, 0], pool_k, pool_v, self.prefix_pages, self.prefix_start, self.resp_pages, self.resp_len,
            scale=scale,
        )  # fmt: skip
        return out[:, None]

    def decode_target(self, layer: int, value_dim: int) -> tuple[torch.Tensor, ...] | None:
        """Where a decoding step writes ``layer``'s keys and values: ``(pool_k, pool_v, pages [rows], offsets
        [rows])``, row ``s``'s at column ``offsets[s]`` of page ``pages[s]``; None in prefill, before the pools
        exist, or when the values' head dim (``value_dim``) is not the keys'."""
        pools = self.layers[layer]
        if self.prefill_rows is not None or pools is None or pools[0].shape[-1] != value_dim:
            return None
        return (*pools, self.write_page, self.write_offset)

    def _allocate(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.prefill_rows is None:
            raise RuntimeError("DecodeCache: a decoding step before any prefill")
        hkv, dk, dv = key.shape[1], key.shape[-1], value.shape[-1]
        like = {"dtype": key.dtype, "device": key.device}
        return (
            torch.zeros(self.pages, hkv, self.page_size, dk, **like),
            torch.zeros(self.pages, hkv, self.page_size, dv, **like),
        )


def shared_prompt_runs(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """How many rows each group has when the rows come in equal runs of the same (padded) prompt, longer than one;
    else 1. input_ids, attention_mask ``[B, P]``."""
    if len(input_ids) < 2:
        return 1
    same = ((input_ids[1:] == input_ids[:-1]) & (attention_mask[1:] == attention_mask[:-1])).all(-1).tolist()
    runs, length = [], 1
    for equal in same:
        if equal:
            length += 1
        else:
            runs.append(length)
            length = 1
    runs.append(length)
    return runs[0] if runs[0] > 1 and len(set(runs)) == 1 else 1


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
    routes: list[Any] | None = None


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
    share_prompts: bool = True,
    kernel: str | None = None,
    kv_tokens: int | None = None,
    page_size: int | None = None,
    lagged_checks: bool | None = None,
    record_routes: bool = False,
) -> Decoded:
    """Sample up to ``max_new_tokens`` for each row of a left-padded batch of prompts.

    input_ids, attention_mask: ``[B, P]`` on the model's device (mask 1 for prompt tokens, 0 for left padding).
    ``seeds`` (``B`` ints; default: drawn from torch's generator) seed each prompt's stream of draws.
    ``share_prompts``: rows in equal runs of the same prompt share its prefill and its cached keys (module
    docstring). ``max_running`` (default ``B``) bounds the rows decoded at once (a multiple of the group size;
    smaller than a group, nothing is shared): groups beyond it wait and take the rows of a group whose samples have
    all stopped, at the next check (every ``check_every`` steps). ``cuda_graph`` (default: on CUDA) replays the
    decode step's forward, and its sampling, as CUDA graphs; ``compile`` runs that forward through ``torch.compile``
    first (compiled once per row count and cache size, which are rounded up so that calls share it). ``kernel``:
    the decode attention and the plain sampler (``torch`` or ``triton``; default: ``triton`` on CUDA).
    ``kv_tokens`` bounds the paged KV cache (:class:`DecodeCache`, pages of ``page_size`` tokens, default
    :data:`runtime.engines.decode_attention.PAGE_SIZE` of the kernel: 64 on a GPU, a row's longest on the CPU;
    default: room for
    every running row's longest response): a waiting group starts only when its prompt's pages and a first page
    per sample are free, and when the running rows' next pages are not, the group that started last is preempted
    (its pages taken back, its rows stopped, the group put first in the queue to start over; its per-prompt
    streams draw the same tokens again). It must hold at least one group's prompt and longest responses.
    ``is_aborted`` is read after every step; once true the call returns what was sampled so far. Before
    ``min_new_tokens`` tokens a row cannot draw a stop id (its logits are -inf there, as transformers'
    min-new-tokens processor does; the log-probs are then of that constrained distribution). ``stopped`` (at each
    check, given the token lists of the rows still running) marks rows as stopped for a reason of the caller's,
    such as a stop string; it only ends them early.
    ``on_cache`` is shown the :class:`DecodeCache` once it is built (tests measure it). ``nucleus``: report each
    draw's kept set (:func:`sample_tokens`) and its log-prob renormalised over it; the sets of the steps since the
    last check are kept on the device and read back at the check, with no sync of their own. ``record_routes``: report
    each prompt's routed experts (:class:`runtime.engines.routes.RouteRecorder`; ``[len(tokens) - 1, layers, topk]``).
    ``lagged_checks`` (default: with ``cuda_graph``): a check decides from the state the previous check saw (copied
    back on a side stream while the GPU runs on), so that the host never waits for the GPU's queue to drain; a row
    that stops is handed back and refilled one block of ``check_every`` steps later, and the check at which every
    row must have stopped (or an abort, or ``nucleus``) still decides from its own step.
    """
    device = input_ids.device
    if cuda_graph is None:
        cuda_graph = device.type == "cuda"
    batch = input_ids.shape[0]
    if seeds is None:
        seeds = torch.randint(0, 2**62, (batch,)).tolist()
    if len(seeds) != batch:
        raise ValueError(f"seeds: one per prompt, got {len(seeds)} for {batch} prompts")
    columns = max_new_tokens
    if compile:  # shapes shared across calls: one compiled graph serves many prompt widths and lengths
        input_ids, attention_mask = _left_pad_to(input_ids, attention_mask, multiple=64, pad_id=pad_id)
        columns = -(-max_new_tokens // 128) * 128
    width = input_ids.shape[1]
    per_group = shared_prompt_runs(input_ids, attention_mask) if share_prompts else 1
    if max_running is not None and max_running < per_group:
        per_group = 1
    groups = batch // per_group
    group_rows = groups if max_running is None else max(1, min(max_running // per_group, groups))
    slots = group_rows * per_group
    all_uniforms = prompt_uniforms(seeds, max_new_tokens)
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    kernel = kernel or default_kernel(device)
    if kv_tokens is not None and kv_tokens < 1:
        raise ValueError(f"kv_tokens must be None or >= 1, got {kv_tokens}")
    page_size = page_size or PAGE_SIZE[kernel](width, columns)
    cache = DecodeCache(
        layers=layers,
        groups=group_rows,
        per_group=per_group,
        width=width,
        max_new_tokens=columns,
        device=device,
        kernel=kernel,
        page_size=page_size,
        pages=None if kv_tokens is None else 1 + -(-kv_tokens // page_size),
    )
    if on_cache is not None:
        on_cache(cache)
    real = attention_mask.bool()
    all_lengths = real.sum(-1)
    all_positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    # Padding queries attend to themselves, so that their cached keys/values stay finite.
    itself = torch.eye(width, dtype=torch.bool, device=device)

    # Per row: the prompt's length, tokens drawn so far, whether it has stopped, its uniforms, what it drew, the
    # token it feeds next; the logits it draws from next.
    lengths = torch.zeros(slots, dtype=torch.long, device=device)
    count = torch.zeros(slots, dtype=torch.long, device=device)
    done = torch.ones(slots, dtype=torch.bool, device=device)
    uniforms = torch.zeros(slots, max_new_tokens, dtype=torch.float32, device=device)
    out_tokens = torch.full((slots, max_new_tokens), pad_id, dtype=torch.long, device=device)
    out_log_probs = torch.zeros(slots, max_new_tokens, dtype=torch.float32, device=device)
    token_in = torch.zeros(slots, dtype=torch.long, device=device)
    logits_in: torch.Tensor | None = None
    is_stop_id: torch.Tensor | None = None
    # transformers takes a 4-D mask as given; decoding steps attend through the cache and ignore it.
    step_mask = torch.ones(slots, 1, 1, 1, dtype=torch.bool, device=device)
    step_model = _compiled(model) if compile else model
    RouteRecorder.detach(model)
    recorder = (
        RouteRecorder(model, group_rows=group_rows, slots=slots, width=width, columns=columns)
        if record_routes
        else None
    )
    last = max_new_tokens - 1

    def start(rows: list[int], starting: list[int]) -> None:
        """Prefill groups ``starting`` into group rows ``rows``: their rows draw next from the prompt's logits."""
        nonlocal logits_in, is_stop_id
        r = torch.tensor(rows, device=device)
        heads = torch.tensor([g * per_group for g in starting], device=device)
        members = torch.arange(per_group, device=device)
        row_ids = (r[:, None] * per_group + members).flatten()
        prompts = (heads[:, None] + members).flatten()
        lengths[row_ids] = all_lengths[prompts]
        count[row_ids] = 0
        done[row_ids] = False
        uniforms[row_ids] = all_uniforms[prompts.cpu()].to(device)
        mask = real[heads]
        cache.prefix_start[r] = cache.width - all_lengths[heads]
        cache.prefill_rows = r
        if recorder:
            recorder.prefill(r)
        try:
            logits = model(
                input_ids=input_ids[heads],
                attention_mask=((causal[None] & mask[:, None, :]) | itself[None])[:, None],
                position_ids=all_positions[heads],
                use_cache=False,
                logits_to_keep=1,
                **{CACHE_KWARG: cache},
            ).logits[:, -1]
        finally:
            cache.prefill_rows = None
        if recorder:
            recorder.prefilled()
        if logits_in is None:
            logits_in = torch.zeros(slots, logits.shape[-1], dtype=logits.dtype, device=device)
            is_stop_id = torch.zeros(logits.shape[-1], dtype=torch.bool, device=device)
            stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
            is_stop_id[stop[stop < logits.shape[-1]]] = True
        logits_in[row_ids] = logits.repeat_interleave(per_group, dim=0)

    def draw() -> torch.Tensor | None:
        """Every live row draws a token from ``logits_in``; returns the kept sets (``nucleus``) of the live rows."""
        logits = logits_in
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
            kernel=kernel,
        )
        live = ~done
        out_tokens.scatter_(1, column, torch.where(live, tokens, out_tokens.gather(1, column)[:, 0])[:, None])
        out_log_probs.scatter_(1, column, torch.where(live, log_probs, out_log_probs.gather(1, column)[:, 0])[:, None])
        count.add_(live)
        done.logical_or_(live & (is_stop_id[tokens] | (count > last)))
        token_in.copy_(torch.where(live, tokens, token_in))
        return None if keep is None else keep & live[:, None]

    def forward() -> None:
        """Feed each row's newest token: rotary position = prompt length + its index; response column = its index."""
        newest = (count - 1).clamp(min=0)
        cache.set_step(newest)
        if recorder:
            recorder.step(newest)
        logits = step_model(
            input_ids=token_in[:, None],
            attention_mask=step_mask,
            position_ids=(lengths + newest)[:, None],
            use_cache=False,
            **{CACHE_KWARG: cache},
        ).logits[:, -1]
        logits_in.copy_(logits)

    prompt_lengths = all_lengths.tolist()

    if lagged_checks is None:
        lagged_checks = cuda_graph
    # A row's pages must reach the columns it writes before the next check's pages take effect: one block of
    # check_every steps, two when the checks look one block behind.
    ahead = (2 if lagged_checks else 1) * check_every + 1

    def admit(g: int, group: int) -> bool:
        """Hand group row ``g`` the pages that group ``group`` starts with (its prompt's, and each sample's first
        ``ahead`` response columns'); False, holding none, when too few are free."""
        if not cache.assign_prompt(g, prompt_lengths[group * per_group]):
            return False
        rows = range(g * per_group, (g + 1) * per_group)
        if sum(cache.cover(s, ahead) for s in rows):
            for s in rows:
                cache.release_row(s)
            cache.release_group(g)
            return False
        return True

    # A step already run eagerly in this process at these shapes (same kernels, same Triton specialisations) needs no
    # eager warm-up before its capture: about 35 ms of Python a call at Qwen3-0.6B's 28 layers.
    shapes = (slots, per_group, cache.prompt_pages, cache.response_pages, kernel, compile, nucleus)
    shapes += (min_new_tokens > 0, top_k, top_p < 1.0, record_routes, str(device))
    warmed = vars(model).setdefault("_rlcore_warmed", set())
    draw_step = _Replayed(draw, cuda_graph, warm=("draw", *shapes) in warmed)
    forward_step = _Replayed(forward, cuda_graph, warm=("forward", *shapes) in warmed)
    results: list[tuple[list[int], list[float], str, list[list[int]]] | None] = [None] * batch
    routes: list[Any] = [None] * batch
    running: list[int | None] = [None] * group_rows  # the group each group row runs
    started = [0] * group_rows  # the step at which each group row's group started (the latest is preempted first)
    open_rows = [False] * slots  # the row's prompt has not handed its response back yet
    waiting = deque(range(groups))
    for g in range(group_rows):
        if not admit(g, waiting[0]):
            break
        running[g] = waiting.popleft()
        open_rows[g * per_group : (g + 1) * per_group] = [True] * per_group
    cache.sync()
    first = [g for g, group in enumerate(running) if group is not None]
    start(first, [running[g] for g in first])
    last_start = 0  # the step at which the latest groups started: every row has stopped max_new_tokens later
    # Top-p replay: each live row's kept set per step since the last check ([slots, V] bool on the device), and per
    # row the nuclei of the prompt it runs, one per token drawn (read back at each check, the host sync there is).
    block_keeps: list[torch.Tensor] = []
    slot_nuclei: list[list[list[int]]] = [[] for _ in range(slots)]
    readback = _Readback(device, slots)
    pending: _Snapshot | None = None  # a lagged check's snapshot, read at the next check
    row_start = [0] * slots  # the check at which each row's prompt started (a snapshot before it knows nothing)
    checks = 0
    step = 0
    while True:
        keep = draw_step()
        if keep is not None:
            block_keeps.append(keep.clone() if cuda_graph else keep)
        step += 1
        aborted = is_aborted()
        fresh: list[tuple[int, int]] = []
        if aborted or step % check_every == 0 or step - last_start == max_new_tokens:
            checks += 1
            now = readback.take(done, count, checks)
            # A lagged check decides from the previous check's snapshot, read while the GPU runs the block since; a
            # check at which every row has stopped (or an abort, or top-p replay's nuclei) decides from this one.
            if lagged_checks and not (aborted or nucleus or step - last_start == max_new_tokens):
                now, pending = pending, now
            else:
                pending = None
            if now is None:
                forward_step()
                continue
            stopped_now, counts = readback.state(now)
            for s in range(slots):
                if row_start[s] >= now.check:  # started after the snapshot: not stopped, nothing drawn
                    stopped_now[s], counts[s] = False, 0
            if block_keeps:
                _take_nuclei(block_keeps, slot_nuclei)
                block_keeps = []
            if stopped is not None:
                going = [s for s in range(slots) if open_rows[s] and not stopped_now[s]]
                going_out = readback.rows(out_tokens, going, now)
                flags = stopped([going_out[s][: counts[s]].tolist() for s in going]) if going else []
                for s, flag in zip(going, flags, strict=True):
                    stopped_now[s] = stopped_now[s] or bool(flag)
            # Only the rows that hand their responses back now come to the host.
            closing = [s for s in range(slots) if open_rows[s] and (stopped_now[s] or aborted)]
            rows_out = readback.rows(out_tokens, closing, now)
            lps_out = readback.rows(out_log_probs, closing, now)
            for s in closing:
                drawn = rows_out[s][: counts[s]].tolist()
                if drawn and drawn[-1] in stop_ids:
                    reason = "stop"
                elif stopped_now[s]:  # the caller's stop, or the length limit
                    reason = "length" if counts[s] == max_new_tokens else "stop"
                else:
                    reason = "abort"
                prompt = running[s // per_group] * per_group + s % per_group
                results[prompt] = (drawn, lps_out[s][: counts[s]].tolist(), reason, slot_nuclei[s][: counts[s]])
                if recorder:
                    routes[prompt] = recorder.take(
                        s, s // per_group, prompt_length=prompt_lengths[prompt], drawn=counts[s]
                    )
                slot_nuclei[s] = []
                open_rows[s] = False
                cache.release_row(s)
            if aborted:
                break
            for g, group in enumerate(running):
                if group is not None and not any(open_rows[g * per_group : (g + 1) * per_group]):
                    running[g] = None
                    cache.release_group(g)
            _cover_or_preempt(cache, running, started, open_rows, stopped_now, counts, slot_nuclei, waiting,
                              per_group=per_group, columns=ahead)  # fmt: skip
            # Set, never cleared: a row may have stopped on the device since a lagged snapshot.
            done.logical_or_(torch.tensor(stopped_now, device=device))
            for g in range(group_rows):
                if running[g] is None and waiting and admit(g, waiting[0]):
                    running[g], started[g] = waiting.popleft(), step
                    fresh.append((g, running[g]))
                    open_rows[g * per_group : (g + 1) * per_group] = [True] * per_group
                    row_start[g * per_group : (g + 1) * per_group] = [checks] * per_group
            if all(group is None for group in running):
                break
            cache.sync()
        forward_step()
        if fresh:
            # After the step's forward: the freed rows' last writes land before their new prompts' prefill.
            start(*map(list, zip(*fresh, strict=True)))
            last_start = step
    replays = {"draw": draw_step, "forward": forward_step}
    warmed.update((name, *shapes) for name, replayed in replays.items() if replayed.warm)
    for g in waiting:
        for prompt in range(g * per_group, (g + 1) * per_group):
            results[prompt] = ([], [], "abort", [])
    RouteRecorder.detach(model)
    empty_lps = torch.zeros(0, dtype=torch.float32)
    return Decoded(
        tokens=[torch.tensor(r[0], dtype=torch.long) for r in results],
        log_probs=[torch.tensor(r[1], dtype=torch.float32) if r[1] else empty_lps for r in results],
        finish=[r[2] for r in results],
        steps=step,
        nucleus=[r[3] for r in results] if nucleus else None,
        routes=routes if recorder else None,
    )


def _cover_or_preempt(
    cache: DecodeCache,
    running: list[int | None],
    started: list[int],
    open_rows: list[bool],
    stopped_now: list[bool],
    counts: list[int],
    slot_nuclei: list[list[list[int]]],
    waiting: deque,
    *,
    per_group: int,
    columns: int,
) -> None:
    """At a check: give every running row pages for its next ``columns`` response columns; while the pool is short,
    preempt the group row whose group started last (its rows stopped and closed, its pages taken back, its group
    first in ``waiting`` again). The lists are the decode loop's, changed in place."""
    while True:
        live = [s for s, on in enumerate(open_rows) if on and not stopped_now[s]]
        if sum(cache.cover(s, counts[s] + columns) for s in live) == 0:
            return
        going = [g for g, group in enumerate(running) if group is not None]
        if len(going) < 2:  # one group always fits (DecodeCache's minimum): rows here cannot be short
            raise RuntimeError("DecodeCache: one running group is short of pages")
        g = max(going, key=lambda g: (started[g], g))
        for s in range(g * per_group, (g + 1) * per_group):
            cache.release_row(s)
            open_rows[s], stopped_now[s], slot_nuclei[s] = False, True, []
        cache.release_group(g)
        waiting.appendleft(running[g])
        running[g] = None


@dataclass
class _Snapshot:
    """The rows' stopped flags and counts as of check ``check``: ``state`` ``[2, slots]`` on the host (pinned, and
    filled once ``ready`` has happened, on a CUDA device); ``after`` marks the snapshot's step on the main stream."""

    check: int
    state: torch.Tensor
    after: torch.cuda.Event | None = None
    ready: torch.cuda.Event | None = None


class _Readback:
    """What the decode loop's checks read back from the device without draining its queue: a snapshot of the rows'
    stopped flags and counts is copied on a side stream after the step that ends a block, and the token and log-prob
    rows of the rows that hand their responses back are gathered on that stream too, so the host waits for the
    snapshot's step only, never for the steps queued after it (on the CPU everything is synchronous)."""

    def __init__(self, device: torch.device, slots: int):
        self.cuda = device.type == "cuda"
        # One stream copies snapshots, one gathers rows: a gather waits for its own snapshot's step only.
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.gather = torch.cuda.Stream(device) if self.cuda else None
        # Two of each: a snapshot is read at the next check at the latest, so its buffers are free two checks on.
        self.device_state = [torch.zeros(2, slots, dtype=torch.long, device=device) for _ in range(2)]
        self.host_state = [torch.zeros(2, slots, dtype=torch.long, pin_memory=self.cuda) for _ in range(2)]

    def take(self, done: torch.Tensor, count: torch.Tensor, check: int) -> _Snapshot:
        buffer = self.device_state[check % 2]
        torch.stack([done.long(), count], out=buffer)
        if not self.cuda:
            return _Snapshot(check, buffer.clone())
        host, after = self.host_state[check % 2], torch.cuda.Event()
        after.record()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(after)
            host.copy_(buffer, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        return _Snapshot(check, host, after, ready)

    def state(self, snapshot: _Snapshot) -> tuple[list[bool], list[int]]:
        """The snapshot's stopped flags and counts (waiting for its copy)."""
        if snapshot.ready is not None:
            snapshot.ready.synchronize()
        return snapshot.state[0].bool().tolist(), snapshot.state[1].tolist()

    def rows(self, table: torch.Tensor, rows: list[int], snapshot: _Snapshot) -> dict[int, torch.Tensor]:
        """Rows ``rows`` of a device ``[slots, columns]`` table on the host, by row index (one gather, one copy),
        read after the snapshot's step: a row's first ``count`` entries, as the snapshot counts them, are final."""
        if not rows:
            return {}
        if not self.cuda:
            return dict(zip(rows, table[torch.tensor(rows)], strict=True))
        with torch.cuda.stream(self.gather):  # after the snapshot's step, not after the steps queued since
            self.gather.wait_event(snapshot.after)
            taken = table[torch.tensor(rows, device=table.device)].cpu()
        return dict(zip(rows, taken, strict=True))


def _left_pad_to(input_ids: torch.Tensor, attention_mask: torch.Tensor, *, multiple: int, pad_id: int):
    """Left-pad ``[B, P]`` prompts to a multiple of ``multiple`` columns."""
    extra = -input_ids.shape[1] % multiple
    if not extra:
        return input_ids, attention_mask
    pad = torch.nn.functional.pad
    return pad(input_ids, (extra, 0), value=pad_id), pad(attention_mask, (extra, 0), value=0)


def _take_nuclei(keeps: list[torch.Tensor], slot_nuclei: list[list[list[int]]]) -> None:
    """Append each step's kept ids to its row's list. keeps: per step ``[slots, V]`` bool, all False for a row
    that did not draw at that step (a live row's set holds at least its drawn token). One copy to the host."""
    stacked = torch.stack(keeps, dim=1)  # [slots, steps, V]
    slots, steps = stacked.shape[:2]
    pairs = stacked.nonzero().cpu()  # (slot, step, id), ordered: by slot, then step, then id
    counts = torch.bincount(pairs[:, 0] * steps + pairs[:, 1], minlength=slots * steps).tolist()
    for at, ids in enumerate(torch.split(pairs[:, 2], counts)):
        if counts[at]:
            slot_nuclei[at // steps].append(ids.tolist())


def _compiled(model: torch.nn.Module):
    """``torch.compile(model)``, made once per model and kept on it. A MoE model's route hooks go in first: the
    compiled step runs the hooks the model had when it was compiled
    (:func:`runtime.engines.routes.install_route_hooks`), so a step compiled by a call without ``record_routes``
    would record nothing for the later calls that ask."""
    compiled = getattr(model, "_rlcore_compiled", None)
    if compiled is None:
        install_route_hooks(model)
        compiled = torch.compile(model, dynamic=False)
        model._rlcore_compiled = compiled
    return compiled


class _Replayed:
    """``fn`` (no arguments, reading and writing fixed buffers) as a CUDA graph: the first call runs it on a side
    stream (warming up cuBLAS and compiling Triton kernels; it is a real step), the second captures it and replays,
    later calls replay; with ``warm`` (the same step ran before in this process) the first call captures. Without
    ``graph`` it just calls ``fn``. Returns ``fn``'s (static) output."""

    def __init__(self, fn: Callable[[], torch.Tensor | None], graph: bool, *, warm: bool = False):
        self.fn, self.use_graph, self.graph, self.warm, self.out = fn, graph, None, warm, None

    def __call__(self) -> torch.Tensor | None:
        if not self.use_graph:
            return self.fn()
        if not self.warm:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self.fn()
            torch.cuda.current_stream().wait_stream(side)
            self.warm = True
            return out
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self.fn()
        self.graph.replay()
        return self.out
