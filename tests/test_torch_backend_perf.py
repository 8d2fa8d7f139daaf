"""The torch backend's speed options on the CPU: sequence packing (``--use-dynamic-batch-size``), the loss inside
the LM head under FSDP2, activation recompute (``--recompute-granularity full``) and one bf16 cast of the weights
per step. Each must leave log-probs, losses and gradients as they are without it."""

import socket

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from rlcore import keys
from rlcore.advantages import compute
from runtime.config import ConfigError, from_dict, validate
from runtime.demo import task
from runtime.demo.tiny_model import make_preset_model, make_tiny_model
from runtime.rollout.sample import Sample
from runtime.train.algo import advantage_config, loss_config, model_roles
from runtime.train.attention import register_attention, varlen_attention
from runtime.train.backends import torch_forward, torch_step
from runtime.train.backends.torch_backend import TorchTrainer
from runtime.train.batch import build_batch
from runtime.train.packing import pack_by_tokens, packed_inputs, padded_inputs

SMALL = {
    "rollout_batch_size": 3,
    "n_samples_per_prompt": 4,
    "rollout_max_response_len": 9,
    "global_batch_size": 12,
    "micro_batch_size": 4,
    "lr": 1e-3,
    "actor_num_gpus_per_node": 1,
    "bf16": "false",
}
# Adam's first step moves every weight by about lr (1e-3) whatever its gradient's size, so a float32 rounding
# difference in a near-zero gradient can show as a few percent of one step.
WEIGHT_ATOL = 5e-5
QWEN3_TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 300,
}


def _cfg(tmp_path, **overrides):
    return validate(from_dict(None, output_dir=str(tmp_path / "out"), **{**SMALL, **overrides}))


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("llama"), alphabet=task.ALPHABET, seed=0))


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    return str(make_preset_model("qwen3-0.6b", path, alphabet=task.ALPHABET, seed=0, **QWEN3_TINY))


def _samples(vocab: int, *, seed: int, n: int = 12) -> list[Sample]:
    """Samples of varied prompt and response lengths (some tool-masked tokens), groups of four."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        prompt = int(torch.randint(1, 8, (), generator=g))
        response = int(torch.randint(1, 10, (), generator=g))
        tokens = torch.randint(4, vocab, (prompt + response,), generator=g).tolist()
        loss_mask = [1] * response
        if response > 3:
            loss_mask[2] = 0
        samples.append(
            Sample(
                index=i // 4,
                group_index=i // 4,
                tokens=tokens,
                response_length=response,
                loss_mask=loss_mask,
                rollout_log_probs=(-torch.rand(response, generator=g) * 3).tolist(),
                reward=float(torch.rand((), generator=g)),
            )
        )
    return samples


def _trainer(path, cfg, **kwargs):
    return TorchTrainer(
        path, train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=1.0, roles=model_roles(cfg), seed=0, **kwargs
    )


def _step(trainer, td, cfg):
    """Old/reference log-probs, one optimizer step; ``(log-probs on the response tokens, metrics, weights after the
    step)``."""
    td = td.clone()
    logs = trainer.compute_log_probs(td)
    td.update(logs)
    within = torch.arange(td[keys.MASK].shape[1])[None, :] < td["response_lengths"][:, None]
    logs = {key: logs[key][within] for key in logs.keys()}
    metrics = trainer.train(compute(td, advantage_config(cfg)), per_step_rows=td.batch_size[0])
    return logs, metrics, trainer.get_weights()


def _assert_same_step(got, expected, *, rtol=1e-4, atol=1e-6):
    (logs, metrics, weights), (logs_e, metrics_e, weights_e) = got, expected
    assert set(logs) == set(logs_e)
    for key in logs_e:
        torch.testing.assert_close(logs[key], logs_e[key], rtol=rtol, atol=1e-5)
    for name in ("loss", "pg_loss", "grad_norm", "entropy", "clipfrac", "approx_kl_old"):
        assert metrics[name] == pytest.approx(metrics_e[name], rel=rtol, abs=atol), name
    assert set(weights) == set(weights_e)
    for name, value in weights.items():
        torch.testing.assert_close(value, weights_e[name], rtol=rtol, atol=WEIGHT_ATOL)


# ---------------------------------------------------------------- packing: the partition and the layouts


@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.integers(40, 120))
def test_pack_by_tokens_partitions_rows_within_the_budget(lengths, budget):
    bins = pack_by_tokens(lengths, max_tokens=budget)
    rows = [i for b in bins for i in b]
    assert sorted(rows) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= budget for b in bins)
    assert all(b == sorted(b) for b in bins) and [b[0] for b in bins] == sorted(b[0] for b in bins)
    assert len(bins) >= -(-sum(lengths) // budget)


def test_pack_by_tokens_balances_and_refuses_an_oversized_row():
    # First fit in row order needs two micro-batches, of 12 and 8 tokens; balanced over two they hold 9 and 11.
    assert pack_by_tokens([3, 3, 3, 3, 8], max_tokens=12) == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="sample 1 has 11 tokens, over --max-tokens-per-gpu 10"):
        pack_by_tokens([3, 11], max_tokens=10)


@given(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=6))
def test_both_layouts_pick_the_position_before_each_response_token(rows):
    prompts = torch.tensor([p for p, _ in rows])
    lengths = torch.tensor([p + r for p, r in rows])
    horizon = max(r for _, r in rows)
    tokens = torch.arange(len(rows) * 12).view(len(rows), 12)
    for layout in (padded_inputs, packed_inputs):
        inputs = layout(tokens, prompts, lengths, horizon=horizon)
        flat = inputs.input_ids.reshape(-1)
        for i, (p, r) in enumerate(rows):
            for t in range(r):
                assert int(flat[inputs.picks[i, t]]) == int(tokens[i, p - 1 + t])
                if inputs.position_ids is not None:
                    assert int(inputs.position_ids.reshape(-1)[inputs.picks[i, t]]) == p - 1 + t
    packed = packed_inputs(tokens, prompts, lengths, horizon=horizon)
    assert packed.input_ids.shape == (1, int(lengths.sum())) and packed.attention_mask is None


def test_layouts_name_bad_shapes():
    with pytest.raises(ValueError, match="prompt_length < length"):
        packed_inputs(torch.zeros(1, 4, dtype=torch.long), torch.tensor([3]), torch.tensor([3]), horizon=1)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
@settings(max_examples=8)
@given(rows=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=2, max_size=5))
def test_packed_forward_gives_the_padded_log_probs_and_gradients_in_float64(arch, attention, rows, request):
    """transformers reads restarting position ids as sequence boundaries (SDPA, block-diagonal causal mask), and
    varlen attention reads the packed row's ``cu_seq_lens`` (on the CPU one SDPA per sequence; padded rows causal
    with no mask): packed and padded log-probs and their gradients equal padded SDPA's to float64 rounding."""
    path = request.getfixturevalue(f"{arch}_path")
    g = torch.Generator().manual_seed(len(rows))
    prompts = torch.tensor([p for p, _ in rows])
    lengths = torch.tensor([p + r for p, r in rows])
    horizon = max(r for _, r in rows)
    tokens = torch.randint(0, _float64_model(path).config.vocab_size, (len(rows), 18), generator=g)
    mask = torch.arange(horizon)[None, :] < (lengths - prompts)[:, None]
    results = []
    for layout, attn in ((padded_inputs, "sdpa"), (padded_inputs, attention), (packed_inputs, attention)):
        model = _float64_model(path, attn)
        model.zero_grad(set_to_none=True)
        inputs = layout(tokens, prompts, lengths, horizon=horizon)
        logits = model(**inputs.model_kwargs(), use_cache=False).logits
        picked = logits.reshape(-1, logits.shape[-1])[inputs.picks]
        targets = tokens.gather(1, (prompts[:, None] + torch.arange(horizon)).clamp(max=17))
        log_probs = torch.log_softmax(picked, -1).gather(-1, targets[..., None])[..., 0]
        log_probs[mask].sum().backward()
        results.append((log_probs.detach()[mask], [p.grad.clone() for p in model.parameters()]))
    (padded, padded_grads), *others = results
    for log_probs, grads in others:
        torch.testing.assert_close(log_probs, padded, rtol=1e-12, atol=1e-12)
        for a, b in zip(grads, padded_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


_MODELS: dict[tuple[str, str], torch.nn.Module] = {}


def _float64_model(path: str, attention: str = "sdpa") -> torch.nn.Module:
    if attention == "varlen":
        register_attention()
    if (path, attention) not in _MODELS:
        _MODELS[path, attention] = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float64, attn_implementation=attention
        )
    return _MODELS[path, attention]


# ---------------------------------------------------------------- the trainer: packed, fused, recompute


def _full_logits(monkeypatch) -> None:
    """The trainer's passes through the model's full logits, never the loss inside the LM head: the log-prob passes'
    (torch_forward) and the step's (torch_step)."""
    # The methods that choose look the name up in these modules: a later move fails here instead of testing nothing.
    readers = {TorchTrainer._micro_log_probs.__module__, TorchTrainer._train_step.__module__}
    assert readers == {torch_forward.__name__, torch_step.__name__}, readers
    for module in (torch_forward, torch_step):
        monkeypatch.setattr(module, "loss_in_head", lambda model: False)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_packed_trainer_equals_the_padded_trainer(llama_path, tmp_path, fused, monkeypatch):
    """Log-probs (actor and reference), loss, metrics and the weights after a step: packed micro-batches of at most
    40 real tokens (90 for the log-prob passes; rows regrouped) against right-padded micro-batches of four rows."""
    if not fused:
        _full_logits(monkeypatch)
    td = build_batch(_samples(len(task.ALPHABET) + 4, seed=1), pad_token_id=0)
    padded_cfg = _cfg(tmp_path, use_kl_loss=True)
    packed_cfg = _cfg(
        tmp_path, use_kl_loss=True, use_dynamic_batch_size=True, max_tokens_per_gpu=40, log_probs_max_tokens_per_gpu=90
    )
    packed = _trainer(llama_path, packed_cfg)
    assert 1 < len(packed._micro_batches(td, log_probs=True)) < len(packed._micro_batches(td))
    # Regrouped: some micro-batch is not a run of consecutive rows (the log-probs come back in row order).
    groups = packed._parts_and_groups(td, log_probs=False)[1]
    assert any(rows != list(range(rows[0], rows[0] + len(rows))) for rows in groups)
    _assert_same_step(_step(packed, td, packed_cfg), _step(_trainer(llama_path, padded_cfg), td, padded_cfg))


def test_the_fused_head_equals_the_full_logits_path(qwen3_path, tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, use_kl_loss=True, use_dynamic_batch_size=True, max_tokens_per_gpu=40)
    td = build_batch(_samples(QWEN3_TINY["vocab_size"], seed=2), pad_token_id=0)
    fused = _step(_trainer(qwen3_path, cfg), td, cfg)
    _full_logits(monkeypatch)
    _assert_same_step(fused, _step(_trainer(qwen3_path, cfg), td, cfg))


class _SavedBytes:
    """Bytes of the activations autograd saves for the backward (parameters left out)."""

    def __init__(self, model):
        self.params = {p.data_ptr() for p in model.parameters()}
        self.total = 0

    def pack(self, tensor):
        if tensor.data_ptr() not in self.params:
            self.total += tensor.numel() * tensor.element_size()
        return tensor


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_recompute_full_gives_the_same_step_and_saves_less(qwen3_path, tmp_path, packed):
    knobs = {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 60} if packed else {}
    td = build_batch(_samples(QWEN3_TINY["vocab_size"], seed=3), pad_token_id=0)
    results, saved = [], []
    for recompute in (None, "full"):
        cfg = _cfg(tmp_path, recompute_granularity=recompute, **knobs)
        trainer = _trainer(qwen3_path, cfg)
        counter = _SavedBytes(trainer.model)
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            results.append(_step(trainer, td, cfg))
        saved.append(counter.total)
    _assert_same_step(results[1], results[0])
    # Each block keeps its input only: well under half of what the whole forward saves.
    assert saved[1] < 0.5 * saved[0], saved


# Inductor compiles the decoder layer on the CPU (about a minute on two shared cores).
@pytest.mark.slow
def test_torch_compile_gives_the_same_step(qwen3_path, tmp_path):
    """--torch-compile (every decoder layer compiled; packed rows of changing length, recompute on) gives the eager
    step's log-probs, loss, metrics and weights in float32, varlen attention included."""
    knobs = {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 60, "attn_implementation": "varlen"}
    td = build_batch(_samples(QWEN3_TINY["vocab_size"], seed=7), pad_token_id=0)
    results = []
    for compiled in (False, True):
        cfg = _cfg(tmp_path, recompute_granularity="full", torch_compile=compiled, **knobs)
        trainer = _trainer(qwen3_path, cfg)
        assert all((m._compiled_call_impl is not None) == compiled for m in trainer.model.model.layers)
        results.append(_step(trainer, td, cfg))
    _assert_same_step(results[1], results[0])


def test_varlen_attention_refuses_what_it_cannot_run():
    q = torch.zeros(2, 4, 6, 8)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="one row"):
        varlen_attention(None, q, q, q, None, cu_seq_lens_q=cu, max_length_q=6)
    with pytest.raises(ValueError, match="dropout"):
        varlen_attention(None, q, q, q, None, dropout=0.1)


def test_bf16_weights_are_cast_once_per_step(llama_path, tmp_path):
    """Under bf16 each float32 weight is cast to bf16 once per optimizer step (the step's bf16 copy), not once per
    micro-batch."""
    cfg = _cfg(tmp_path, bf16="true", micro_batch_size=2)
    trainer = _trainer(llama_path, cfg)
    td = build_batch(_samples(len(task.ALPHABET) + 4, seed=4), pad_token_id=0)
    td.update(trainer.compute_log_probs(td))
    td = compute(td, advantage_config(cfg))
    weights = {p.data_ptr(): name for name, p in trainer.model.named_parameters() if p.dim() == 2}

    class CountCasts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.casts: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            source = args[0] if args else None
            if func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype) and torch.is_tensor(source):
                if source.data_ptr() in weights and kwargs.get("dtype", args[1:2] or None) is not None:
                    self.casts[weights[source.data_ptr()]] = self.casts.get(weights[source.data_ptr()], 0) + 1
            return func(*args, **kwargs)

    counter = CountCasts()
    with counter:
        metrics = trainer.train(td, per_step_rows=12)
    assert metrics["num_steps"] == 1 and len(trainer._micro_batches(td)) == 6
    assert counter.casts and set(counter.casts.values()) == {1}, counter.casts
    assert len(counter.casts) == len(weights)


def test_bf16_step_sums_bf16_micro_batch_gradients_in_float32(llama_path, tmp_path, monkeypatch):
    """Inside a bf16 step the weights are bf16 copies (forward and backward wholly in bf16); each micro-batch's bf16
    gradients are summed in float32, and the optimizer sees float32 weights with those sums as gradients."""
    cfg = _cfg(tmp_path, bf16="true", micro_batch_size=4)
    trainer = _trainer(llama_path, cfg)
    td = build_batch(_samples(len(task.ALPHABET) + 4, seed=6), pad_token_id=0)
    td.update(trainer.compute_log_probs(td))
    td = compute(td, advantage_config(cfg))
    params = dict(trainer.model.named_parameters())
    sums: dict[str, torch.Tensor] = {}
    seen: dict[str, set] = {"inside": set(), "optimizer": set()}
    accumulate = TorchTrainer._accumulate_grads

    def recording(self):
        for name, p in params.items():
            seen["inside"].add(p.dtype)
            if p.grad is not None:
                seen["inside"].add(p.grad.dtype)
                sums[name] = sums.get(name, 0) + p.grad.double()
        accumulate(self)

    grads = {}
    step = TorchTrainer._optimizer_step

    def capturing(self, *args):
        for name, p in params.items():
            seen["optimizer"].update({p.dtype, p.grad.dtype})
            grads[name] = p.grad.clone()
        return step(self, *args)

    monkeypatch.setattr(TorchTrainer, "_accumulate_grads", recording)
    monkeypatch.setattr(TorchTrainer, "_optimizer_step", capturing)
    trainer.train(td, per_step_rows=12)
    assert len(trainer._micro_batches(td)) == 3
    assert seen == {"inside": {torch.bfloat16}, "optimizer": {torch.float32}}
    assert set(grads) == set(params) and set(sums) == set(params)
    for name, grad in grads.items():
        torch.testing.assert_close(grad.double(), sums[name], rtol=1e-6, atol=1e-30)
    assert all(p.dtype == torch.float32 and p.grad is None for p in trainer.model.parameters())


# ---------------------------------------------------------------- FSDP2: the loss inside the sharded LM head


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp_rank(rank, world_size, port, path, cfg, td, out_dir):
    torch.set_num_threads(1)
    calls = []
    fused = torch_step.linear_rl_loss

    def counting(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)

    torch_step.linear_rl_loss = counting
    trainer = _trainer(path, cfg, rank=rank, world_size=world_size, master_port=port)
    per_rank = td.batch_size[0] // world_size
    shard = td[rank * per_rank : (rank + 1) * per_rank]
    logs = trainer.compute_log_probs(shard)
    metrics = trainer.train(shard, per_step_rows=per_rank)
    weights = trainer.get_weights()
    torch.save((len(calls), logs.to_dict(), metrics, weights), f"{out_dir}/rank{rank}.pt")
    trainer.shutdown()


# 10 to 70 s each on two shared CPU cores (two spawned ranks); tests/test_runtime_loop.py's Ray FSDP test covers the
# padded fused path in the default run.
@pytest.mark.slow
@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 30, "recompute_granularity": "full"},
        {"torch_compile": True},
    ],
    ids=["padded", "packed+recompute", "compiled"],
)
def test_two_fsdp_ranks_train_through_the_fused_head_as_one_process(qwen3_path, tmp_path, knobs):
    """Two gloo FSDP2 ranks (the LM head tied to the sharded embeddings) take the fused path and give the single
    process's log-probs, loss, gradient norm and weights."""
    cfg = _cfg(tmp_path, actor_num_gpus_per_node=2, micro_batch_size=2, use_kl_loss=True, **knobs)
    td = build_batch(_samples(QWEN3_TINY["vocab_size"], seed=5), pad_token_id=0)
    single = _trainer(qwen3_path, cfg)
    logs = single.compute_log_probs(td)
    td.update(logs)
    td = compute(td, advantage_config(cfg))
    expected = single.train(td, per_step_rows=12)
    expected_weights = single.get_weights()

    mp.start_processes(
        _fsdp_rank,
        args=(2, _free_port(), qwen3_path, cfg, td, str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    for rank, (calls, rank_logs, metrics, _) in enumerate(results):
        assert calls >= 1, "the FSDP rank did not train through linear_rl_loss"
        for key in logs.keys():
            torch.testing.assert_close(rank_logs[key], logs[key][rank * 6 : (rank + 1) * 6], rtol=1e-4, atol=1e-5)
        for name in ("grad_norm", "pg_loss", "loss", "entropy", "clipfrac"):
            assert metrics[name] == pytest.approx(expected[name], rel=1e-4, abs=1e-6), name
    weights = results[0][3]
    assert set(weights) == set(expected_weights)
    for name, value in weights.items():
        torch.testing.assert_close(value, expected_weights[name], atol=WEIGHT_ATOL, rtol=1e-4)


# ---------------------------------------------------------------- flags


def test_packing_and_recompute_flags_are_checked(tmp_path):
    with pytest.raises(ConfigError) as info:
        _cfg(tmp_path, use_dynamic_batch_size=True)
    assert "--use-dynamic-batch-size packs micro-batches by --max-tokens-per-gpu: set it" in info.value.problems
    with pytest.raises(ConfigError) as info:
        _cfg(tmp_path, recompute_granularity="selective")
    assert any(p.startswith("--recompute-granularity selective") for p in info.value.problems)
    cfg = _cfg(tmp_path, recompute_granularity="full", use_dynamic_batch_size=True, max_tokens_per_gpu=64)
    assert cfg.train.recompute_granularity == "full" and cfg.train.use_dynamic_batch_size
    # The Megatron backend takes it too (padded groups by real tokens: tests/test_megatron_dynamic_batch.py).
    cfg = _cfg(tmp_path, train_backend="megatron", use_dynamic_batch_size=True, max_tokens_per_gpu=64)
    assert cfg.train.train_backend == "megatron" and cfg.train.use_dynamic_batch_size
