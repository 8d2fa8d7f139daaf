"""Decode attention over the embedded engine's split KV cache: one query token per sample against its group's shared
prompt keys, then its own response keys.

The cache keeps a prompt's keys once per group of samples (``prefix_k [G, Hkv, P, Dk]``, the prompt left-padded to
``P`` columns, real from ``prefix_start[g]``) and each sample's response keys apart
(``resp_k [G, Hkv, n, M, Dk]``, real in ``[0, resp_len[s])``). Sample ``j`` of group ``g`` is row ``s = g * n + j``.
Query heads ``h`` of a key/value head ``h // (H / Hkv)`` read that head's keys once for the whole query group, and
a group's ``n`` samples read their shared prompt keys once together: nothing is repeated in memory, and only the
real columns are read (the cache is sized for the longest response, the reads follow each row's length).

- :func:`decode_attention_reference`: plain torch (float32 scores and softmax), the CPU path and the tests' reference.
- :func:`decode_attention_triton`: Triton (flash-decoding): the key range of each (group, key/value head) is cut into
  parts of ``chunk`` columns (the prompt's parts read by all ``n`` samples' queries at once, a response's parts by its
  sample's), each part keeps its running max, sum and weighted values over the blocks of ``block_n`` columns that
  hold real keys (the others are skipped: at short contexts most of the cache's capacity is), and a second kernel
  merges the parts.

Both take scores and the softmax in float32 and round the probabilities to the values' dtype before they weight the
values (flash attention's arithmetic); the output is in the query's dtype.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU path needs no Triton
    triton = None


def _check(query, prefix_k, prefix_v, prefix_start, resp_k, resp_v, resp_len) -> tuple[int, ...]:
    """The sizes ``(G, n, Hkv, g, P, M, Dk, Dv)``; ValueError names the argument whose shape does not fit."""
    if prefix_k.dim() != 4 or resp_k.dim() != 5:
        raise ValueError(
            f"prefix_k must be [G, Hkv, P, Dk] and resp_k [G, Hkv, n, M, Dk], got {prefix_k.shape}, {resp_k.shape}"
        )
    groups, hkv, width, dk = prefix_k.shape
    n, m = resp_k.shape[2], resp_k.shape[3]
    dv = prefix_v.shape[-1]
    if query.dim() != 3 or query.shape[0] != groups * n or query.shape[1] % hkv or query.shape[2] != dk:
        raise ValueError(f"query must be [G * n, H, Dk] = [{groups * n}, k * {hkv}, {dk}], got {list(query.shape)}")
    if tuple(prefix_v.shape) != (groups, hkv, width, dv) or tuple(resp_v.shape) != (groups, hkv, n, m, dv):
        raise ValueError(f"prefix_v {list(prefix_v.shape)} / resp_v {list(resp_v.shape)} do not match the keys")
    if tuple(resp_k.shape) != (groups, hkv, n, m, dk):
        raise ValueError(f"resp_k must be [{groups}, {hkv}, n, M, {dk}], got {list(resp_k.shape)}")
    if tuple(prefix_start.shape) != (groups,) or tuple(resp_len.shape) != (groups * n,):
        raise ValueError(
            f"prefix_start must be [{groups}] and resp_len [{groups * n}], got "
            f"{list(prefix_start.shape)}, {list(resp_len.shape)}"
        )
    return groups, n, hkv, query.shape[1] // hkv, width, m, dk, dv


def decode_attention_reference(
    query: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    prefix_start: torch.Tensor,
    resp_k: torch.Tensor,
    resp_v: torch.Tensor,
    resp_len: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """query ``[G * n, H, Dk]``, prefix_k/v ``[G, Hkv, P, Dk/Dv]``, prefix_start ``[G]`` int, resp_k/v
    ``[G, Hkv, n, M, Dk/Dv]``, resp_len ``[G * n]`` int -> ``[G * n, H, Dv]`` in query's dtype (module docstring).
    Reads every column and masks; a row needs at least one real key (a non-empty prompt)."""
    groups, n, hkv, g, width, m, dk, dv = _check(query, prefix_k, prefix_v, prefix_start, resp_k, resp_v, resp_len)
    q = query.float().view(groups, n, hkv, g, dk).transpose(1, 2)  # [G, Hkv, n, g, Dk]
    on_prompt = torch.einsum("bhngd,bhpd->bhngp", q, prefix_k.float()) * scale
    on_response = torch.einsum("bhngd,bhnmd->bhngm", q, resp_k.float()) * scale
    prompt_real = torch.arange(width, device=query.device)[None] >= prefix_start[:, None]  # [G, P]
    response_real = (torch.arange(m, device=query.device)[None] < resp_len[:, None]).view(groups, 1, n, 1, m)
    on_prompt = on_prompt.masked_fill(~prompt_real[:, None, None, None, :], float("-inf"))
    on_response = on_response.masked_fill(~response_real, float("-inf"))
    probs = torch.softmax(torch.cat([on_prompt, on_response], dim=-1), dim=-1).to(prefix_v.dtype).float()
    out = torch.einsum("bhngp,bhpd->bhngd", probs[..., :width], prefix_v.float())
    out = out + torch.einsum("bhngm,bhnmd->bhngd", probs[..., width:], resp_v.float())
    return out.transpose(1, 2).reshape(groups * n, hkv * g, dv).to(query.dtype)


def decode_attention_triton(
    query: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    prefix_start: torch.Tensor,
    resp_k: torch.Tensor,
    resp_v: torch.Tensor,
    resp_len: torch.Tensor,
    *,
    scale: float,
    chunk: int = 256,
    block_n: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """:func:`decode_attention_reference` as two Triton kernels that read only the real columns. ``chunk``: key
    columns per part (a power of two, a multiple of ``block_n``); ``block_n``: columns per inner step."""
    groups, n, hkv, g, width, m, dk, dv = _check(query, prefix_k, prefix_v, prefix_start, resp_k, resp_v, resp_len)
    if chunk % block_n or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"chunk must be a multiple of block_n, a power of two >= 16; got {chunk}, {block_n}")
    for name, t in (("prefix_k", prefix_k), ("prefix_v", prefix_v), ("resp_k", resp_k), ("resp_v", resp_v)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if query.stride(-1) != 1:
        query = query.contiguous()
    rows = max(16, triton.next_power_of_2(n * g))
    block_dk, block_dv = max(16, triton.next_power_of_2(dk)), max(16, triton.next_power_of_2(dv))
    prefix_parts, resp_parts = -(-width // chunk), -(-m // chunk)
    parts = prefix_parts + n * resp_parts
    run_max = torch.empty(groups, hkv, parts, rows, dtype=torch.float32, device=query.device)
    run_sum = torch.empty_like(run_max)
    weighted = torch.empty(groups, hkv, parts, rows, block_dv, dtype=torch.float32, device=query.device)
    _part_kernel[(groups, hkv, parts)](
        query, prefix_k, prefix_v, resp_k, resp_v, prefix_start, resp_len, run_max, run_sum, weighted,
        scale, width, m, n, prefix_parts, resp_parts, query.stride(0), query.stride(1),
        HKV=hkv, GROUP=g, DK=dk, DV=dv, CHUNK=chunk, ROWS=rows, BLOCK_N=block_n, BLOCK_DK=block_dk,
        BLOCK_DV=block_dv, IEEE=query.dtype == torch.float32, num_warps=num_warps,
    )  # fmt: skip
    out = torch.empty(groups * n, hkv * g, dv, dtype=query.dtype, device=query.device)
    _merge_kernel[(groups, hkv)](
        run_max, run_sum, weighted, out, n, parts, out.stride(0), out.stride(1),
        HKV=hkv, GROUP=g, DV=dv, ROWS=rows, BLOCK_DV=block_dv, PARTS_CAP=triton.next_power_of_2(parts),
        num_warps=num_warps,
    )  # fmt: skip
    return out


DECODE_ATTENTION = {"torch": decode_attention_reference, "triton": decode_attention_triton}


def default_kernel(device: torch.device) -> str:
    """``triton`` on a CUDA device where Triton imports, else ``torch``."""
    return "triton" if device.type == "cuda" and triton is not None else "torch"


if triton is not None:

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        """``a @ b`` accumulated in float32; in exact float32 arithmetic for float32 inputs (not TF32)."""
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _attend_block(
        q, k_base, v_base, start, lo, hi, row_on, scale, run_max, run_sum, acc,
        DK: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
        IEEE: tl.constexpr,
    ):  # fmt: skip
        """One block of ``BLOCK_N`` key columns from ``start`` (those outside ``[lo, hi)`` masked, their loads reading
        nothing) folded into the rows' running max, sum and weighted values (flash attention's online softmax)."""
        col = start + tl.arange(0, BLOCK_N)
        dk = tl.arange(0, BLOCK_DK)
        dv = tl.arange(0, BLOCK_DV)
        col_real = (col >= lo) & (col < hi)
        k = tl.load(k_base + col[:, None] * DK + dk[None, :], mask=col_real[:, None] & (dk[None, :] < DK), other=0.0)
        s = tl.where(row_on[:, None] & col_real[None, :], _dot(q, tl.trans(k), IEEE) * scale, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(s, 1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(run_max - shift)
        v = tl.load(v_base + col[:, None] * DV + dv[None, :], mask=col_real[:, None] & (dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        return new_max, run_sum * alpha + tl.sum(p, 1), acc

    @triton.jit
    def _part_kernel(
        q_ptr, pk_ptr, pv_ptr, rk_ptr, rv_ptr, start_ptr, len_ptr, max_ptr, sum_ptr, acc_ptr,
        scale, width, m, n, prefix_parts, resp_parts, stride_qs, stride_qh,
        HKV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, CHUNK: tl.constexpr,
        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
        IEEE: tl.constexpr,
    ):  # fmt: skip
        """One part of one (group, key/value head): a chunk of the prompt's columns for all the group's query rows,
        or a chunk of one sample's response columns for its rows. Writes the rows' running max, sum and
        (unnormalised) weighted values."""
        grp = tl.program_id(0)
        kv = tl.program_id(1)
        part = tl.program_id(2)
        parts = prefix_parts + n * resp_parts
        rows = tl.arange(0, ROWS)
        member = rows // GROUP
        head = kv * GROUP + rows % GROUP
        row_real = rows < n * GROUP
        dk = tl.arange(0, BLOCK_DK)
        dv = tl.arange(0, BLOCK_DV)
        q_at = q_ptr + (grp * n + member)[:, None] * stride_qs + head[:, None] * stride_qh + dk[None, :]
        q = tl.load(q_at, mask=row_real[:, None] & (dk[None, :] < DK), other=0.0)
        if part < prefix_parts:
            first = part * CHUNK
            lo = tl.load(start_ptr + grp).to(tl.int32)
            hi = width
            k_base = pk_ptr + (grp * HKV + kv).to(tl.int64) * width * DK
            v_base = pv_ptr + (grp * HKV + kv).to(tl.int64) * width * DV
            row_on = row_real
        else:
            sample = (part - prefix_parts) // resp_parts
            first = ((part - prefix_parts) % resp_parts) * CHUNK
            lo = 0
            hi = tl.load(len_ptr + grp * n + sample).to(tl.int32)
            k_base = rk_ptr + ((grp * HKV + kv) * n + sample).to(tl.int64) * m * DK
            v_base = rv_ptr + ((grp * HKV + kv) * n + sample).to(tl.int64) * m * DV
            row_on = row_real & (member == sample)
        run_max = tl.full([ROWS], float("-inf"), tl.float32)
        run_sum = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_DV], tl.float32)
        # Only the blocks that hold real columns ([lo, hi)) run: a part past a row's length, or a prompt part left
        # of its start, loads and multiplies nothing. (A fixed trip count with a skip, not a loop bounded by loaded
        # values, which Triton's interpreter cannot run.)
        for offset in range(0, CHUNK, BLOCK_N):
            start = first + offset
            if (start < hi) & (start + BLOCK_N > lo):
                run_max, run_sum, acc = _attend_block(
                    q, k_base, v_base, start, lo, hi, row_on, scale, run_max, run_sum, acc,
                    DK=DK, DV=DV, BLOCK_N=BLOCK_N, BLOCK_DK=BLOCK_DK, BLOCK_DV=BLOCK_DV, IEEE=IEEE,
                )  # fmt: skip
        at = (grp * HKV + kv) * parts + part
        tl.store(max_ptr + at * ROWS + rows, run_max)
        tl.store(sum_ptr + at * ROWS + rows, run_sum)
        tl.store(acc_ptr + (at * ROWS + rows)[:, None] * BLOCK_DV + dv[None, :], acc, mask=(run_sum > 0)[:, None])

    @triton.jit
    def _merge_kernel(
        max_ptr, sum_ptr, acc_ptr, out_ptr, n, parts, stride_os, stride_oh,
        HKV: tl.constexpr, GROUP: tl.constexpr, DV: tl.constexpr, ROWS: tl.constexpr, BLOCK_DV: tl.constexpr,
        PARTS_CAP: tl.constexpr,
    ):  # fmt: skip
        """Merge the parts of one (group, key/value head) into each query row's attention output."""
        grp = tl.program_id(0)
        kv = tl.program_id(1)
        rows = tl.arange(0, ROWS)
        dv = tl.arange(0, BLOCK_DV)
        base = (grp * HKV + kv) * parts
        # PARTS_CAP (a power of two >= parts) bounds the loops, so that a kernel serves many prompt widths.
        top = tl.full([ROWS], float("-inf"), tl.float32)
        for p in range(PARTS_CAP):
            part_max = tl.load(max_ptr + (base + p) * ROWS + rows, mask=(rows >= 0) & (p < parts), other=float("-inf"))
            top = tl.maximum(top, part_max)
        total = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_DV], tl.float32)
        for p in range(PARTS_CAP):
            part_sum = tl.load(sum_ptr + (base + p) * ROWS + rows, mask=(rows >= 0) & (p < parts), other=0.0)
            has = part_sum > 0
            part_max = tl.load(max_ptr + (base + p) * ROWS + rows, mask=has, other=0.0)
            weight = tl.where(has, tl.exp(part_max - top), 0.0)
            total += part_sum * weight
            part_acc = tl.load(acc_ptr + ((base + p) * ROWS + rows)[:, None] * BLOCK_DV + dv[None, :],
                               mask=has[:, None], other=0.0)  # fmt: skip
            acc += part_acc * weight[:, None]
        row_real = rows < n * GROUP
        out = acc / tl.where(row_real, total, 1.0)[:, None]
        member = rows // GROUP
        head = kv * GROUP + rows % GROUP
        out_at = out_ptr + (grp * n + member)[:, None] * stride_os + head[:, None] * stride_oh + dv[None, :]
        tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=row_real[:, None] & (dv[None, :] < DV))
