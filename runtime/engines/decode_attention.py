"""Decode attention over the embedded engine's paged KV cache: one query token per sample against its group's shared
prompt keys, then its own response keys.

The cache (:class:`runtime.engines.decode.DecodeCache`) keeps keys and values in pages of ``S`` columns
(``pool_k [pages, Hkv, S, Dk]``, ``pool_v [pages, Hkv, S, Dv]``), handed out as the work needs them. A group's
prompt is kept once for its ``n`` samples, in the pages ``prefix_pages[g]`` (``[G, Pb]``; column ``c`` of the prompt,
left-padded to ``Pb * S`` columns and real from ``prefix_start[g]``, is at offset ``c % S`` of page
``prefix_pages[g, c // S]``); each sample's response keys in its own pages ``resp_pages[s]`` (``[G * n, Mb]``, real in
``[0, resp_len[s])``). Sample ``j`` of group ``g`` is row ``s = g * n + j``. Page ids of columns that hold nothing
real (the prompt's padding, a response's columns not reached yet) are never read, whatever they name. Query heads
``h`` of a key/value head ``h // (H / Hkv)`` read that head's keys once for the whole query group, and a group's
``n`` samples read their shared prompt keys once together: nothing is repeated in memory, and only the real columns
are read.

- :func:`decode_attention_reference`: plain torch (float32 scores and softmax) over the pages gathered into one
  dense tensor, the CPU path and the tests' reference.
- :func:`decode_attention_triton`: Triton (flash-decoding): the key range of each (group, key/value head) is cut into
  parts of ``chunk`` columns (512 by default; the prompt's parts read by all ``n`` samples' queries at once, a
  response's parts by its sample's), each part keeps its running max, sum and weighted values over the pages that
  hold real keys (the others are skipped), and a second kernel merges the parts.
- :func:`store_decode_kv`: a decoding step's new key and value of each row written to its page and offset.

Both attentions take scores and the softmax in float32 and round the probabilities to the values' dtype before they
weight the values (flash attention's arithmetic); the output is in the query's dtype.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU path needs no Triton
    triton = None


def _check(query, pool_k, pool_v, prefix_pages, prefix_start, resp_pages, resp_len) -> tuple[int, ...]:
    """The sizes ``(G, n, Hkv, g, S, Pb, Mb, Dk, Dv)``; ValueError names the argument whose shape does not fit."""
    if pool_k.dim() != 4 or pool_v.dim() != 4 or pool_k.shape[:3] != pool_v.shape[:3]:
        raise ValueError(
            f"pool_k / pool_v must be [pages, Hkv, S, Dk/Dv] alike but for the last dim, got {list(pool_k.shape)}, "
            f"{list(pool_v.shape)}"
        )
    _, hkv, page, dk = pool_k.shape
    dv = pool_v.shape[-1]
    if prefix_pages.dim() != 2 or resp_pages.dim() != 2 or prefix_start.shape != prefix_pages.shape[:1]:
        raise ValueError(
            f"prefix_pages must be [G, Pb], prefix_start [G] and resp_pages [G * n, Mb], got "
            f"{list(prefix_pages.shape)}, {list(prefix_start.shape)}, {list(resp_pages.shape)}"
        )
    groups, rows = prefix_pages.shape[0], resp_pages.shape[0]
    if rows % groups or tuple(resp_len.shape) != (rows,):
        raise ValueError(f"resp_pages must be [G * n, Mb] and resp_len [G * n] for G = {groups}, got {rows} rows")
    if query.dim() != 3 or query.shape[0] != rows or query.shape[1] % hkv or query.shape[2] != dk:
        raise ValueError(f"query must be [G * n, H, Dk] = [{rows}, k * {hkv}, {dk}], got {list(query.shape)}")
    n = rows // groups
    return groups, n, hkv, query.shape[1] // hkv, page, prefix_pages.shape[1], resp_pages.shape[1], dk, dv


def gather_pages(pool: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """pool ``[pages, Hkv, S, D]``, pages ``[R, Np]`` int64 -> ``[R, Hkv, Np * S, D]``: each row's pages side by
    side (one copy, a view of it when each row has one page)."""
    rows, count = pages.shape
    _, hkv, page, dim = pool.shape
    taken = pool.index_select(0, pages.flatten())
    if count == 1:
        return taken
    return taken.view(rows, count, hkv, page, dim).transpose(1, 2).reshape(rows, hkv, count * page, dim)


def decode_attention_reference(
    query: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    prefix_pages: torch.Tensor,
    prefix_start: torch.Tensor,
    resp_pages: torch.Tensor,
    resp_len: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """query ``[G * n, H, Dk]``, pool_k/v ``[pages, Hkv, S, Dk/Dv]``, prefix_pages ``[G, Pb]`` int, prefix_start
    ``[G]`` int, resp_pages ``[G * n, Mb]`` int, resp_len ``[G * n]`` int -> ``[G * n, H, Dv]`` in query's dtype
    (module docstring). Gathers every page into a dense tensor and masks; a row needs at least one real key."""
    groups, n, hkv, g, page, pb, mb, dk, dv = _check(
        query, pool_k, pool_v, prefix_pages, prefix_start, resp_pages, resp_len
    )
    prefix_pages, resp_pages = prefix_pages.long(), resp_pages.long()
    prefix_k, prefix_v = gather_pages(pool_k, prefix_pages), gather_pages(pool_v, prefix_pages)  # [G, Hkv, P, D]
    resp_k = gather_pages(pool_k, resp_pages).unflatten(0, (groups, n)).transpose(1, 2)  # [G, Hkv, n, M, D]
    resp_v = gather_pages(pool_v, resp_pages).unflatten(0, (groups, n)).transpose(1, 2)
    width, m = pb * page, mb * page
    q = query.float().view(groups, n, hkv, g, dk).transpose(1, 2)  # [G, Hkv, n, g, Dk]
    on_prompt = torch.einsum("bhngd,bhpd->bhngp", q, prefix_k.float()) * scale
    on_response = torch.einsum("bhngd,bhnmd->bhngm", q, resp_k.float()) * scale
    prompt_real = torch.arange(width, device=query.device)[None] >= prefix_start[:, None]  # [G, P]
    response_real = (torch.arange(m, device=query.device)[None] < resp_len[:, None]).view(groups, 1, n, 1, m)
    on_prompt = on_prompt.masked_fill(~prompt_real[:, None, None, None, :], float("-inf"))
    on_response = on_response.masked_fill(~response_real, float("-inf"))
    probs = torch.softmax(torch.cat([on_prompt, on_response], dim=-1), dim=-1).to(pool_v.dtype).float()
    out = torch.einsum("bhngp,bhpd->bhngd", probs[..., :width], prefix_v.float())
    out = out + torch.einsum("bhngm,bhnmd->bhngd", probs[..., width:], resp_v.float())
    return out.transpose(1, 2).reshape(groups * n, hkv * g, dv).to(query.dtype)


def decode_attention_triton(
    query: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    prefix_pages: torch.Tensor,
    prefix_start: torch.Tensor,
    resp_pages: torch.Tensor,
    resp_len: torch.Tensor,
    *,
    scale: float,
    chunk: int = 512,
    num_warps: int | None = None,
) -> torch.Tensor:
    """:func:`decode_attention_reference` as two Triton kernels that read only the real columns, a page (``S``
    columns, a power of two >= 16) per inner step. ``chunk``: key columns per part (a multiple of ``S``);
    ``num_warps``: the part kernel's (default :func:`part_warps`)."""
    groups, n, hkv, g, page, pb, mb, dk, dv = _check(
        query, pool_k, pool_v, prefix_pages, prefix_start, resp_pages, resp_len
    )
    if chunk % page or page < 16 or page & (page - 1):
        raise ValueError(f"the page size must be a power of two >= 16 dividing chunk; got {page}, chunk {chunk}")
    for name, t in (
        ("pool_k", pool_k),
        ("pool_v", pool_v),
        ("prefix_pages", prefix_pages),
        ("resp_pages", resp_pages),
    ):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if query.stride(-1) != 1:
        query = query.contiguous()
    rows = max(16, triton.next_power_of_2(n * g))
    block_dk, block_dv = max(16, triton.next_power_of_2(dk)), max(16, triton.next_power_of_2(dv))
    width, m = pb * page, mb * page
    prefix_parts, resp_parts = -(-width // chunk), -(-m // chunk)
    parts = prefix_parts + n * resp_parts
    num_warps = num_warps or part_warps(groups * hkv * parts)
    run_max = torch.empty(groups, hkv, parts, rows, dtype=torch.float32, device=query.device)
    run_sum = torch.empty_like(run_max)
    weighted = torch.empty(groups, hkv, parts, rows, block_dv, dtype=torch.float32, device=query.device)
    _part_kernel[(groups, hkv, parts)](
        query, pool_k, pool_v, prefix_pages, resp_pages, prefix_start, resp_len, run_max, run_sum, weighted,
        scale, pb, mb, n, prefix_parts, resp_parts, query.stride(0), query.stride(1),
        HKV=hkv, GROUP=g, DK=dk, DV=dv, CHUNK=chunk, ROWS=rows, PAGE=page, BLOCK_DK=block_dk,
        BLOCK_DV=block_dv, IEEE=query.dtype == torch.float32, num_warps=num_warps,
    )  # fmt: skip
    out = torch.empty(groups * n, hkv * g, dv, dtype=query.dtype, device=query.device)
    _merge_kernel[(groups, hkv)](
        run_max, run_sum, weighted, out, n, parts, out.stride(0), out.stride(1),
        HKV=hkv, GROUP=g, DV=dv, ROWS=rows, BLOCK_DV=block_dv, PARTS_CAP=triton.next_power_of_2(parts),
        num_warps=4,
    )  # fmt: skip
    return out


def part_warps(programs: int) -> int:
    """The part kernel's warps for a launch of ``programs`` parts: two when there are many (more of them resident
    per SM), eight when few (more loads in flight in each). Measured on one H100 at Qwen3-0.6B's heads (8 key/value
    heads of 128, pages of 64, parts of 512 columns): 256 rows at 512 columns 221 us with two warps against 244 with
    eight (and 240 us at main's 256-column parts and four warps); 8 prompts of 1024 tokens x 8 samples 60 us with
    eight against 87 with two."""
    return 2 if programs >= 1024 else 8


def store_decode_kv_torch(
    pool_k: torch.Tensor, pool_v: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor,
    offsets: torch.Tensor,
) -> None:  # fmt: skip
    """Row ``s``'s key ``[Hkv, Dk]`` and value ``[Hkv, Dv]`` (key ``[R, Hkv, Dk]``, value ``[R, Hkv, Dv]``) go to
    page ``pages[s]`` at column ``offsets[s]`` of pool_k / pool_v ``[pages, Hkv, S, D]``."""
    pool_k[pages, :, offsets] = key
    pool_v[pages, :, offsets] = value


def store_decode_kv_triton(
    pool_k: torch.Tensor, pool_v: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor,
    offsets: torch.Tensor,
) -> None:  # fmt: skip
    """:func:`store_decode_kv_torch` in one Triton kernel (torch's indexed assignment is several kernels each)."""
    rows, hkv, dk = key.shape
    dv = value.shape[-1]
    if value.shape[:2] != key.shape[:2] or pool_k.shape[1] != hkv or pool_k.shape[-1] != dk or pool_v.shape[-1] != dv:
        raise ValueError(f"store_decode_kv: key {list(key.shape)} / value {list(value.shape)} do not fit the pools")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or not (pool_k.is_contiguous() and pool_v.is_contiguous()):
        raise ValueError("store_decode_kv: the pools must be contiguous and key/value rows contiguous")
    _store_kv_kernel[(rows, hkv)](
        pool_k, pool_v, key, value, pages, offsets, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        HKV=hkv, PAGE=pool_k.shape[2], DK=dk, DV=dv, BLOCK_DK=triton.next_power_of_2(dk),
        BLOCK_DV=triton.next_power_of_2(dv),
    )  # fmt: skip


DECODE_ATTENTION = {"torch": decode_attention_reference, "triton": decode_attention_triton}
# the decode attention's name -> how a decoding step stores its keys and values
STORE_DECODE_KV = {"torch": store_decode_kv_torch, "triton": store_decode_kv_triton}
# the decode attention's name -> the KV cache's default page size for a call of (prompt width, response columns):
# the Triton kernel's block of columns; for torch, which gathers a row's pages into one tensor and reads every
# column, one page per prompt and per response (a power of two >= 16), so that the gather is one copy
PAGE_SIZE = {
    "torch": lambda width, columns: max(16, 1 << (max(width, columns) - 1).bit_length()),
    "triton": lambda width, columns: 64,
}


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
        # ``scale`` as float32 whatever type it arrives as: inductor passes a Python float to a kernel it compiles as
        # a float64 scalar, which made the running max float64 inside the loop's branch (a Triton compile error under
        # --engine-compile in float32, 2026-11-27 on an H200); Triton's own launch passes it as float32 already.
        s = _dot(q, tl.trans(k), IEEE) * tl.cast(scale, tl.float32)
        s = tl.where(row_on[:, None] & col_real[None, :], s, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(s, 1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(run_max - shift)
        v = tl.load(v_base + col[:, None] * DV + dv[None, :], mask=col_real[:, None] & (dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        return new_max, run_sum * alpha + tl.sum(p, 1), acc

    @triton.jit
    def _part_kernel(
        q_ptr, pk_ptr, pv_ptr, prefix_pages_ptr, resp_pages_ptr, start_ptr, len_ptr, max_ptr, sum_ptr, acc_ptr,
        scale, pb, mb, n, prefix_parts, resp_parts, stride_qs, stride_qh,
        HKV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, CHUNK: tl.constexpr,
        ROWS: tl.constexpr, PAGE: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
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
            hi = pb * PAGE
            table = prefix_pages_ptr + grp.to(tl.int64) * pb
            row_on = row_real
        else:
            sample = (part - prefix_parts) // resp_parts
            first = ((part - prefix_parts) % resp_parts) * CHUNK
            lo = 0
            hi = tl.load(len_ptr + grp * n + sample).to(tl.int32)
            table = resp_pages_ptr + (grp * n + sample).to(tl.int64) * mb
            row_on = row_real & (member == sample)
        run_max = tl.full([ROWS], float("-inf"), tl.float32)
        run_sum = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_DV], tl.float32)
        # Only the pages that hold real columns ([lo, hi)) are read: a part past a row's length, or a prompt page
        # left of its start, loads and multiplies nothing. (A fixed trip count with a skip, not a loop bounded by
        # loaded values, which Triton's interpreter cannot run.)
        for offset in range(0, CHUNK, PAGE):
            start = first + offset
            if (start < hi) & (start + PAGE > lo):
                page = tl.load(table + start // PAGE).to(tl.int64)
                # Column c of this page is at (page * HKV + kv) * PAGE + c - start in the pools' [pages, Hkv, S] rows.
                at = (page * HKV + kv) * PAGE - start
                run_max, run_sum, acc = _attend_block(
                    q, pk_ptr + at * DK, pv_ptr + at * DV, start, lo, hi, row_on, scale, run_max, run_sum, acc,
                    DK=DK, DV=DV, BLOCK_N=PAGE, BLOCK_DK=BLOCK_DK, BLOCK_DV=BLOCK_DV, IEEE=IEEE,
                )  # fmt: skip
        at = (grp * HKV + kv) * parts + part
        tl.store(max_ptr + at * ROWS + rows, run_max)
        tl.store(sum_ptr + at * ROWS + rows, run_sum)
        tl.store(acc_ptr + (at * ROWS + rows)[:, None] * BLOCK_DV + dv[None, :], acc, mask=(run_sum > 0)[:, None])

    @triton.jit
    def _store_kv_kernel(
        pk_ptr, pv_ptr, k_ptr, v_ptr, pages_ptr, offsets_ptr, stride_ks, stride_kh, stride_vs, stride_vh,
        HKV: tl.constexpr, PAGE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
        BLOCK_DV: tl.constexpr,
    ):  # fmt: skip
        """Row ``s``'s key and value of key/value head ``h`` to its page and offset."""
        row = tl.program_id(0).to(tl.int64)
        kv = tl.program_id(1)
        page = tl.load(pages_ptr + row).to(tl.int64)
        slot = (page * HKV + kv) * PAGE + tl.load(offsets_ptr + row).to(tl.int64)
        dk = tl.arange(0, BLOCK_DK)
        dv = tl.arange(0, BLOCK_DV)
        k = tl.load(k_ptr + row * stride_ks + kv * stride_kh + dk, mask=dk < DK)
        v = tl.load(v_ptr + row * stride_vs + kv * stride_vh + dv, mask=dv < DV)
        tl.store(pk_ptr + slot * DK + dk, k, mask=dk < DK)
        tl.store(pv_ptr + slot * DV + dv, v, mask=dv < DV)

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
