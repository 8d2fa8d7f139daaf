"""The embedded engine's decode loop on a GPU: the CUDA graph against the eager loop, and bf16 log-probs against a
full forward. Skipped without CUDA (``pytest -q tests/test_engine_decode_cuda.py`` on a GPU machine)."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from runtime.demo import task
from runtime.demo.tiny_model import make_preset_model
from runtime.engines import HFEngine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# A 2-layer model of Qwen3-0.6B's shape otherwise (GQA 16/8, QK-norm, tied 151,936-token head), in bfloat16.
SHAPE = {"num_hidden_layers": 2}


@pytest.fixture(scope="module")
def engine_and_prompts(tmp_path_factory):
    path = make_preset_model("qwen3-0.6b", tmp_path_factory.mktemp("q"), alphabet=task.ALPHABET, seed=0, **SHAPE)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(r["prompt"][: 4 + i % 9])["input_ids"] for i, r in enumerate(task.make_records(24, seed=1))]
    return HFEngine(str(path), seed=0), prompts


def _run(engine, prompts, *, graph: bool, seed: int, running: int | None = None, **params):
    """Generate with every prompt's stream seeded from ``seed`` (the engine's call count starts again at 0)."""
    engine.cuda_graph, engine.max_running_requests = graph, running
    engine.set_rng_state({**engine.get_rng_state(), "seed": seed, "generate_calls": 0})
    try:
        return engine.generate(prompts, SamplingParams(max_new_tokens=48, **params))
    finally:
        engine.max_running_requests = None


@pytest.mark.parametrize("params", [{}, {"temperature": 0.7, "top_p": 0.8, "top_k": 50}])
def test_the_cuda_graph_replays_the_eager_loop(engine_and_prompts, params):
    engine, prompts = engine_and_prompts
    graph = _run(engine, prompts, graph=True, seed=3, **params)
    # The second call at these shapes captures its graphs without an eager warm-up step first.
    again = _run(engine, prompts, graph=True, seed=3, **params)
    eager = _run(engine, prompts, graph=False, seed=3, **params)
    assert [g.token_ids for g in again] == [g.token_ids for g in graph]
    assert [g.log_probs for g in again] == [g.log_probs for g in graph]
    same = sum(g.token_ids == e.token_ids for g, e in zip(graph, eager, strict=True))
    gap = max(
        abs(a - b) for g, e in zip(graph, eager, strict=True) for a, b in zip(g.log_probs, e.log_probs, strict=True)
    )
    print(f"graph vs eager: {same}/{len(prompts)} rows identical, max log-prob gap {gap:.2e}")
    assert same == len(prompts) and gap == 0.0


def _full_forward_gaps(model, prompts, gens, temperature: float) -> list[float]:
    """Per response, the largest gap between its log-probs and a full forward of the unpadded row."""
    gaps = []
    with torch.no_grad():
        for prompt, g in zip(prompts, gens, strict=True):
            ids = torch.tensor([prompt + g.token_ids], device="cuda")
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
            ref = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
            gaps.append((torch.tensor(g.log_probs, device="cuda") - ref).abs().max().item())
    return gaps


def test_bf16_log_probs_match_a_full_forward_of_each_row(engine_and_prompts):
    engine, prompts = engine_and_prompts
    gens = _run(engine, prompts, graph=True, seed=5, temperature=0.8)
    gaps = _full_forward_gaps(engine.model, prompts, gens, 0.8)
    print(
        f"bf16 engine vs full forward: max |log-prob gap| {max(gaps):.3e}, "
        f"mean of row maxima {sum(gaps) / len(gaps):.3e}"
    )
    # bf16 activations: the step-by-step cache and the full forward round differently.
    assert max(gaps) < 0.1


def test_refill_on_the_gpu_ends_at_stop_ids_and_keeps_the_log_prob_contract(engine_and_prompts):
    """8 slots over 24 prompts. 2,000 stop ids end about 1 in 76 draws of the near-uniform random model, so the
    responses have mixed lengths and slots are refilled."""
    engine, prompts = engine_and_prompts
    stops = tuple(range(1000, 3000))
    params = {"temperature": 0.8, "stop_token_ids": stops}
    whole = _run(engine, prompts, graph=True, seed=7, **params)
    refilled = _run(engine, prompts, graph=True, seed=7, running=8, **params)
    lengths = [len(g.token_ids) for g in refilled]
    assert len(set(lengths)) > 3 and min(lengths) < 48
    for g in refilled:
        assert not set(stops) & set(g.token_ids[:-1])
        assert g.finish_reason == ("stop" if g.token_ids[-1] in stops else "length")
    gaps = _full_forward_gaps(engine.model, prompts, refilled, 0.8)
    same = sum(a.token_ids == b.token_ids for a, b in zip(whole, refilled, strict=True))
    print(
        f"refill (8 slots) vs all at once, bf16: {same}/{len(prompts)} responses identical; largest log-prob gap to a "
        f"full forward {max(gaps):.3e}"
    )
    # bf16 matmuls may round differently for 8 rows than for 24, and the random model's near-uniform distribution
    # over 151,936 tokens turns any such difference into a different draw: identical responses are reported only.
    assert max(gaps) < 0.1


def test_a_groups_samples_share_one_prefill_on_the_gpu(engine_and_prompts):
    """Four prompts x six samples in a row: the engine prefills each prompt once; each sample's bf16 log-probs keep
    the contract against a full forward of its row, and sharing changes no draw's arithmetic beyond bf16 rounding."""
    engine, prompts = engine_and_prompts
    grouped = [p for p in prompts[:4] for _ in range(6)]
    shared = _run(engine, grouped, graph=True, seed=9, temperature=0.8)
    engine.share_prompts = False
    try:
        apart = _run(engine, grouped, graph=True, seed=9, temperature=0.8)
    finally:
        engine.share_prompts = True
    gaps = _full_forward_gaps(engine.model, grouped, shared, 0.8)
    same = sum(a.token_ids == b.token_ids for a, b in zip(shared, apart, strict=True))
    print(f"shared prompts: {same}/{len(grouped)} responses as unshared; largest log-prob gap {max(gaps):.3e}")
    assert max(gaps) < 0.1


def test_the_triton_decode_attention_replays_the_torch_one(engine_and_prompts):
    """The Triton kernel and the plain torch attention (every cache column, masked) give the same draws up to bf16
    rounding of the attention output: log-probs of the same tokens close, most responses identical."""
    engine, prompts = engine_and_prompts
    triton_run = _run(engine, prompts, graph=True, seed=4, temperature=0.8)
    engine.attention_kernel = "torch"
    try:
        torch_run = _run(engine, prompts, graph=True, seed=4, temperature=0.8)
    finally:
        engine.attention_kernel = None
    same = sum(a.token_ids == b.token_ids for a, b in zip(triton_run, torch_run, strict=True))
    gaps = _full_forward_gaps(engine.model, prompts, triton_run, 0.8)
    print(f"triton vs torch decode attention: {same}/{len(prompts)} identical; gap to a full forward {max(gaps):.3e}")
    # bf16 attention outputs round differently (summation order), and the near-uniform random model turns that
    # into other draws: identical responses are reported only; each run keeps the log-prob contract.
    assert max(gaps) < 0.1 and max(_full_forward_gaps(engine.model, prompts, torch_run, 0.8)) < 0.1


def test_the_fused_kernels_round_as_the_hf_modules_do(engine_and_prompts):
    """Each fused kernel against the torch ops it replaces, in bf16 on the GPU: rotary bit for bit (products and sum
    rounded alike, by integer arithmetic a compiler cannot fold); RMSNorm and SiLU x up at most one bf16 step apart,
    and rarely (float32 summation order; Triton's fast exp and rsqrt); the whole fused model's log-probs within bf16
    rounding of the HF one."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    from runtime.engines.fused import add_rms_norm, fuse_model, rms_norm, rotary, silu_mul

    engine, prompts = engine_and_prompts
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()

    norm = Qwen3RMSNorm(1024, eps=1e-6).cuda().bfloat16()
    norm.weight.data = randn(1024, scale=0.3) + 1
    x = randn(256, 1024, scale=2.0)
    gate, up = randn(256, 3072, scale=3.0), randn(256, 3072)
    q, k, cos, sin = randn(8, 16, 16, 128), randn(8, 16, 8, 128), randn(8, 16, 128), randn(8, 16, 128)
    rq, rk = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    fq, fk = rotary(q, k, cos, sin)
    assert torch.equal(fq, rq.transpose(1, 2)) and torch.equal(fk, rk.transpose(1, 2))
    assert torch.equal(add_rms_norm(x, up[:, :1024].contiguous(), norm.weight, 1e-6)[0], x + up[:, :1024])
    for name, got, want in (
        ("rms_norm", rms_norm(x, norm.weight, 1e-6), norm(x)),
        ("silu_mul", silu_mul(torch.cat([gate, up], -1)), torch.nn.functional.silu(gate) * up),
        ("add_rms_norm", add_rms_norm(x, up[:, :1024].contiguous(), norm.weight, 1e-6)[1], norm(x + up[:, :1024])),
    ):
        equal = (got == want).float().mean().item()
        # One bf16 step at the value: 2**-7 of its magnitude's power of two.
        step = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp(min=1e-30))) - 7)
        print(f"{name}: {equal:.5f} of elements equal to torch's")
        assert equal > 0.99 and bool(((got.float() - want.float()).abs() <= step).all())
    ids = torch.tensor([p[:4] for p in prompts], device="cuda")
    with torch.no_grad():
        fused = engine.model(input_ids=ids, use_cache=False).logits.float()
        fuse_model(engine.model, on=False)
        try:
            plain = engine.model(input_ids=ids, use_cache=False).logits.float()
        finally:
            fuse_model(engine.model)
    gap = (torch.log_softmax(fused, -1) - torch.log_softmax(plain, -1)).abs().max().item()
    print(f"fused vs HF modules, bf16: largest log-prob gap {gap:.3e}")
    assert gap < 0.05


def test_released_weights_come_back_merged_and_free_their_memory(engine_and_prompts):
    """Releasing the weights drops the merged q/k/v and gate/up tensors with them (the device memory goes back);
    resuming merges them again, the parameters views of them, and the engine generates what it generated before."""
    engine, prompts = engine_and_prompts
    before = _run(engine, prompts[:4], graph=False, seed=9)
    held = torch.cuda.memory_allocated()
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    engine.release_memory(["weights"])
    assert torch.cuda.memory_allocated() <= held - weights
    engine.resume_memory(["weights"])
    for layer in engine.model.model.layers:
        weight, _, _ = layer.self_attn._rlcore_merged
        assert layer.self_attn.v_proj.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
        assert torch.equal(weight[: layer.self_attn.q_proj.weight.shape[0]], layer.self_attn.q_proj.weight)
    after = _run(engine, prompts[:4], graph=False, seed=9)
    assert [g.token_ids for g in after] == [g.token_ids for g in before]


def test_a_small_paged_cache_on_the_gpu_preempts_and_keeps_the_log_prob_contract(engine_and_prompts):
    """24 prompts over 8 rows, pages of 16 columns and 48-token responses (three pages each), a cache of 14 pages:
    groups wait for pages and some are preempted and start over, inside the CUDA-graph loop. Every response keeps
    the log-prob contract against a full forward of its row, and every page comes back."""
    from runtime.engines.decode import decode

    engine, prompts = engine_and_prompts
    width = max(map(len, prompts))
    ids = torch.tensor([[engine.pad_token_id] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = (ids != engine.pad_token_id).long()
    for row, p in enumerate(prompts):
        mask[row, width - len(p) :] = 1
    caches, starts = [], []

    def watch(cache) -> None:
        caches.append(cache)
        assign_prompt = cache.assign_prompt

        def counted(g: int, length: int) -> bool:
            starts.append(assign_prompt(g, length))
            return starts[-1]

        cache.assign_prompt = counted

    out = decode(
        engine.model, ids, mask, max_new_tokens=48, temperature=0.8, top_k=-1, top_p=1.0, stop_ids=[],
        pad_id=engine.pad_token_id, seeds=list(range(24)), max_running=8, page_size=16, kv_tokens=16 * 14,
        on_cache=watch, cuda_graph=True,
    )  # fmt: skip
    assert sum(starts) > len(prompts), "some group should have been preempted"
    assert caches[0].pages_in_use() == 0 and out.finish == ["length"] * 24
    gens = [
        SimpleNamespace(token_ids=t.tolist(), log_probs=lp.tolist())
        for t, lp in zip(out.tokens, out.log_probs, strict=True)
    ]
    gaps = _full_forward_gaps(engine.model, prompts, gens, 0.8)
    restarts = sum(starts) - 24
    print(f"paged cache of 14 pages, {restarts} restarts: largest log-prob gap to a full forward {max(gaps):.3e}")
    assert max(gaps) < 0.1
