"""megatron-core 0.16.1 without Transformer Engine: each bug of ``runtime.train.backends.megatron_compat`` shown in the
unpatched library (so that a version that fixes it fails here and its workaround is dropped), and the workaround
shown to fix it: the MoE router's forward, MLA's construction, MLA's core attention with a narrower value head, the
alltoall token dispatcher on the CPU (an MoE layer against transformers' Qwen3-MoE block on the same weights), and
MLA's gradients at tensor parallelism 2 (against TP=1's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import socket

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402

from runtime.train.backends import megatron_compat  # noqa: E402
from runtime.train.backends.megatron_attention import SDPADotProductAttention  # noqa: E402
from runtime.train.backends.megatron_build import _cpu_shims  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_tf32")

moe_utils = importlib.import_module(megatron_compat.MOE_UTILS)
mla = importlib.import_module(megatron_compat.MLA)
router = importlib.import_module(megatron_compat.ROUTER)
distrib_optimizer = importlib.import_module(megatron_compat.DISTRIB_OPTIMIZER)


@pytest.fixture(scope="module")
def model_parallel():
    """One gloo rank with megatron-core's parallel state (TP=EP=1), under the backend's CPU shims."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    megatron_compat.apply_no_te_workarounds()
    try:
        with _cpu_shims():
            yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture
def unpatched(monkeypatch):
    """The library as it loads: moe_utils' TE names unbound, MLA's HAVE_TE as its import left it (True)."""
    megatron_compat.apply_no_te_workarounds()
    for name in megatron_compat.MOE_UTILS_TE_NAMES:
        monkeypatch.delattr(moe_utils, name)
    monkeypatch.setattr(mla, "HAVE_TE", True)
    monkeypatch.setattr(router.TopKRouter, "_apply_expert_bias", megatron_compat.original_expert_bias())
    monkeypatch.setattr(
        distrib_optimizer.DistributedOptimizer,
        "sharded_param_state_fully_reshardable",
        megatron_compat.original_fully_reshardable(),
    )
    yield
    megatron_compat.apply_no_te_workarounds()


def test_no_transformer_engine_here():
    assert importlib.util.find_spec("transformer_engine") is None


def test_router_gating_raises_name_error_until_the_te_names_are_bound(unpatched):
    x, w = torch.randn(5, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    names = [w.name for w in megatron_compat.WORKAROUNDS]
    assert [w.name for w in megatron_compat.WORKAROUNDS if w.present()] == names
    with pytest.raises(NameError, match="te_general_gemm"):
        moe_utils.router_gating_linear(x, w, None, torch.float32)
    assert megatron_compat.WORKAROUNDS[0].name in megatron_compat.apply_no_te_workarounds()
    assert megatron_compat.apply_no_te_workarounds() == []
    out = moe_utils.router_gating_linear(x, w, None, torch.float64)
    torch.testing.assert_close(out, x @ w.T, rtol=0, atol=0)


def mla_spec():
    """megatron-core's local MLA attention spec with the backend's core attention (the local one takes no MLA)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    attention = get_gpt_layer_local_spec(
        multi_latent_attention=True, normalization="RMSNorm", qk_layernorm=True
    ).submodules.self_attention
    submodules = dataclasses.replace(attention.submodules, core_attention=SDPADotProductAttention)
    return dataclasses.replace(attention, submodules=submodules)


def test_mla_believes_te_is_present_and_fails_to_build_until_told(unpatched, model_parallel):
    from megatron.core.transformer.spec_utils import build_module

    config = mla_config()
    # The MagicMock standing in for TE makes TELinear no class: MLASelfAttention's isinstance check raises.
    assert mla.HAVE_TE and not isinstance(mla.TELinear, type)
    with pytest.raises(TypeError, match="isinstance"):
        build_module(mla_spec(), config=config, layer_number=1)
    megatron_compat.apply_no_te_workarounds()
    assert mla.HAVE_TE is False
    module = build_module(mla_spec(), config=config, layer_number=1)
    hidden = torch.randn(7, 2, config.hidden_size)
    out, _ = module(hidden, attention_mask=None)
    assert out.shape == hidden.shape and torch.isfinite(out).all()


def mla_config():
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_head_dim=8,
        qk_pos_emb_head_dim=4,
        v_head_dim=6,
        normalization="RMSNorm",
        rope_type="rope",
        rotary_base=10000,
        use_cpu_initialization=True,
        add_bias_linear=False,
        params_dtype=torch.float32,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )


def test_local_attention_takes_no_value_head_and_the_sdpa_one_sizes_its_output_by_it(model_parallel):
    config = mla_config()
    with pytest.raises(TypeError, match="k_channels"):  # Megatron-LM #1589: fails once upstream takes them
        DotProductAttention(config, 1, AttnMaskType.causal, "self", k_channels=12, v_channels=6, softmax_scale=0.3)
    module = SDPADotProductAttention(
        config, 1, AttnMaskType.causal, "self", k_channels=12, v_channels=6, softmax_scale=0.3
    )
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(5, 2, 4, 12, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(5, 2, 4, 6, generator=g, dtype=torch.float64)
    out = module(q, k, v, attention_mask=None)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * 0.3
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).reshape(5, 2, 4 * 6)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)  # float64 both sides


def test_alltoall_dispatcher_needs_a_cuda_stream_on_the_cpu_until_shimmed(model_parallel, monkeypatch):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    config, groups = moe_config(), ProcessGroupCollection.use_mpu_process_groups()
    # The class as it is outside the backend's CPU shims (which the fixture has entered).
    monkeypatch.setattr(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", None)
    with pytest.raises((RuntimeError, AssertionError), match="CUDA|cuda|Torch not compiled"):
        MoEAlltoAllTokenDispatcher(2, [0, 1], config=config, pg_collection=groups)
    with megatron_compat.cpu_dispatcher_shims():
        dispatcher = MoEAlltoAllTokenDispatcher(2, [0, 1], config=config, pg_collection=groups)
        assert dispatcher.cuda_dtoh_stream is not None


def moe_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        **overrides,
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=8,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp64",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=torch.float64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def qwen3_moe_block():
    """transformers' Qwen3-MoE block (4 experts, top-2 renormalised) in float64 with random weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf_config = Qwen3MoeConfig(
        hidden_size=16, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True
    )
    hf = Qwen3MoeSparseMoeBlock(hf_config).double()
    with torch.no_grad():
        # A standalone block is not initialised (transformers initialises whole models); a wide router, as
        # transformers' default init nearly ties the experts' scores.
        hf.gate.weight.normal_(0, 1.0)
        hf.experts.gate_up_proj.normal_(0, 0.3)
        hf.experts.down_proj.normal_(0, 0.3)
    return hf


def copy_block(hf, layer, *, first_expert: int = 0) -> None:
    """transformers' block's weights into Megatron's MoE layer, whose local expert i is global expert first + i."""
    with torch.no_grad():
        layer.router.weight.copy_(hf.gate.weight)
        for i, expert in enumerate(layer.experts.local_experts):
            expert.linear_fc1.weight.copy_(hf.experts.gate_up_proj[first_expert + i])
            expert.linear_fc2.weight.copy_(hf.experts.down_proj[first_expert + i])


def test_moe_layer_on_the_cpu_equals_transformers_qwen3_moe_block(model_parallel):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    spec = get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm")
    torch.manual_seed(0)
    layer = build_module(spec.submodules.mlp, config=moe_config()).double()
    hf = qwen3_moe_block()
    copy_block(hf, layer)
    x = torch.randn(6, 3, 16, dtype=torch.float64)  # [s, b, h], Megatron's layout
    out, _ = layer(x)
    expected = hf(x.transpose(0, 1).contiguous()).transpose(0, 1)  # transformers' is [b, s, h]
    # float64 both sides, except that transformers' router takes its softmax in float32: the gate weights carry float32
    # rounding (2^-24 relative), a few 1e-8 of outputs of order 1. A different expert choice would differ by O(1).
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    out.square().sum().backward()
    assert layer.router.weight.grad is not None and layer.experts.local_experts[0].linear_fc1.weight.grad is not None


def _expert_parallel_rank(rank: int, port: int, out: dict) -> None:
    """One of two gloo ranks at EP=2: the MoE layer holds experts [2 * rank, 2 * rank + 2) of a seeded transformers
    block and runs this rank's own tokens, first with the dispatcher's split sizes as megatron-core hands them to gloo
    (the error is recorded), then shimmed (its output is recorded beside the whole block's on the same tokens)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2, create_gloo_process_groups=False)
    megatron_compat.apply_no_te_workarounds()
    try:
        with _cpu_shims():
            torch.manual_seed(0)
            hf = qwen3_moe_block()
            layer = build_module(
                get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm").submodules.mlp,
                config=moe_config(expert_model_parallel_size=2),
            ).double()
            copy_block(hf, layer, first_expert=2 * rank)
            x = torch.randn(5 + rank, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
            with _unshimmed_all_to_all(), pytest.raises(TypeError) as refused:
                layer(x)
            got, _ = layer(x)
            expected = hf(x.transpose(0, 1).contiguous()).transpose(0, 1)
            torch.save((str(refused.value)[:200], got.detach(), expected.detach()), f"{out}.{rank}")
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


@contextlib.contextmanager
def _unshimmed_all_to_all():
    import torch.distributed as dist

    shimmed = dist.all_to_all_single
    dist.all_to_all_single = shimmed.__closure__[0].cell_contents  # the original, captured by the shim
    try:
        yield
    finally:
        dist.all_to_all_single = shimmed


def test_expert_parallel_over_gloo_needs_int_split_sizes(gloo_ranks, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Each rank saves its results to a file (a multiprocessing manager's dict of tensors crashed its server process
    # now and then, handing storages over by file descriptor).
    out = str(tmp_path / "ep")
    gloo_ranks.run(_expert_parallel_rank, port, out)
    for rank in (0, 1):
        refused, got, expected = torch.load(f"{out}.{rank}", weights_only=False)
        # megatron-core hands the split sizes over as tensors, which gloo's all_to_all_single does not take.
        assert "all_to_all_single(): incompatible function arguments" in refused
        # As the one-process test: float64, but transformers' router softmax in float32.
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def mla_tp_config(**overrides):
    """:func:`mla_config` in float64. At TP=2 its latent (16 + 4 rotary columns) is cut into 10 columns a rank: rank 1
    holds the rotary part, rank 0 none of it."""
    return dataclasses.replace(mla_config(), params_dtype=torch.float64, **overrides)


MLA_TOKENS, MLA_BATCH = 6, 2


def mla_grads(module, x: torch.Tensor, probe: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every parameter's gradient and the input's (``"input"``) of ``(module(x) * probe).sum()``."""
    x = x.clone().requires_grad_()
    out, _ = module(x, attention_mask=None)
    (out * probe).sum().backward()
    return {**{name: p.grad.detach().clone() for name, p in module.named_parameters()}, "input": x.grad.detach()}


def _mla_tensor_parallel_rank(
    rank: int, port: int, weights: dict, x: torch.Tensor, probe: torch.Tensor, out: str
) -> None:
    """One of two gloo ranks at TP=2: megatron-core's ``MLASelfAttention`` and the backend's
    (:func:`megatron_compat.whole_latent_mla_attention`), each holding this rank's cut of ``weights`` (the TP=1
    module's), record their gradients of the same loss (saved to ``out.<rank>``)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.spec_utils import build_module

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ps.initialize_model_parallel(2, 1, create_gloo_process_groups=False)
    megatron_compat.apply_no_te_workarounds()
    grads = {}
    try:
        with _cpu_shims():
            classes = {
                "megatron-core": mla.MLASelfAttention,
                "workaround": megatron_compat.whole_latent_mla_attention(),
            }
            for what, cls in classes.items():
                module = build_module(
                    dataclasses.replace(mla_spec(), module=cls),
                    config=mla_tp_config(tensor_model_parallel_size=2),
                    layer_number=1,
                )
                with torch.no_grad():
                    for name, p in module.named_parameters():
                        p.copy_(rank_cut(weights[name], p, rank))
                grads[what] = mla_grads(module, x, probe)
        torch.save(grads, f"{out}.{rank}")
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def rank_cut(whole: torch.Tensor, param: torch.Tensor, rank: int, tp_size: int = 2) -> torch.Tensor:
    """``rank``'s cut of a TP=1 tensor as megatron-core shards ``param`` (whole where it is not sharded)."""
    if not getattr(param, "tensor_model_parallel", False):
        return whole
    return whole.chunk(tp_size, dim=param.partition_dim)[rank]


def test_mla_at_tp2_keeps_one_ranks_share_of_the_keys_rotary_gradient_until_the_latent_is_handed_whole(
    model_parallel, gloo_ranks, tmp_path
):
    """megatron-core 0.16.1's MLA at TP=2 (the local spec's column-parallel ``linear_kv_down_proj``) against the same
    weights at TP=1, in float64: the rotary rows of ``linear_kv_down_proj``'s gradient (and the input's, which they
    feed) hold only the rank-1 heads' share, every other gradient is right; the backend's attention gets them all
    right. Fails once megatron-core sums that gradient itself: the workaround
    (``megatron_compat.whole_latent_mla_attention``) is then dropped."""
    from megatron.core.transformer.spec_utils import build_module

    torch.manual_seed(0)
    whole = build_module(
        dataclasses.replace(mla_spec(), module=mla.MLASelfAttention), config=mla_tp_config(), layer_number=1
    )
    weights = {name: p.detach().clone() for name, p in whole.named_parameters()}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(MLA_TOKENS, MLA_BATCH, 32, generator=g, dtype=torch.float64)
    probe = torch.randn(MLA_TOKENS, MLA_BATCH, 32, generator=g, dtype=torch.float64)
    want = mla_grads(whole, x, probe)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = str(
        tmp_path / "mla"
    )  # files, not a manager's dict: see test_expert_parallel_over_gloo_needs_int_split_sizes
    gloo_ranks.run(_mla_tensor_parallel_rank, port, weights, x, probe, path)
    out = {(r, what): g for r in (0, 1) for what, g in torch.load(f"{path}.{r}", weights_only=False).items()}
    params = dict(whole.named_parameters())
    down, rotary = "linear_kv_down_proj.weight", whole.config.qk_pos_emb_head_dim
    # float64 throughout; at TP=2 the heads' partial products are added in another order (a few ulps of 1e-16).
    close = dict(rtol=1e-10, atol=1e-12)
    for rank in (0, 1):
        for name, grad in want.items():
            cut = grad if name == "input" else rank_cut(grad, params[name], rank)
            torch.testing.assert_close(out[(rank, "workaround")][name], cut, **close, msg=f"rank {rank} {name}")
            if (rank, name) not in ((1, down), (0, "input"), (1, "input")):
                torch.testing.assert_close(out[(rank, "megatron-core")][name], cut, **close, msg=f"{rank} {name}")
    # The bug: rank 1's rotary rows of the down projection (its latent rows are right) hold only its own heads'
    # share of the gradient, and so does the input's gradient on both ranks, which those rows feed.
    rows, plain = rank_cut(want[down], params[down], 1), out[(1, "megatron-core")][down]
    torch.testing.assert_close(plain[:-rotary], rows[:-rotary], **close)
    off = ((plain[-rotary:] - rows[-rotary:]).abs().max() / rows[-rotary:].abs().max()).item()
    assert off > 1e-3, (
        f"megatron-core sums the key's rotary gradient over TP now (off by {off:.1e}): drop the workaround"
    )
    for rank in (0, 1):
        assert not torch.allclose(out[(rank, "megatron-core")]["input"], want["input"], **close)


def _bucketed_optimizer():
    """A megatron-core ``DistributedDataParallel`` of four parameters in three gradient buckets (``bucket_size`` 40,
    each bucket padded to 128 elements), and a ``DistributedOptimizer`` over its real buffers and range maps whose
    main weights and moments are known tensors (built without ``__init__``, which asks for CUDA): the state its
    ``sharded_param_state_fully_reshardable`` must save, parameter by parameter."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
    module = MegatronModule(config=config)
    for name, shape in {"a": (37, 3), "b": (5, 7), "c": (11,), "d": (100,)}.items():
        module.register_parameter(name, torch.nn.Parameter(torch.zeros(shape)))
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=40
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)
    buckets = ddp.buffers[0].buckets
    assert len(buckets) == 3 and all(b.numel_unpadded < b.grad_data.numel() for b in buckets)
    optimizer = object.__new__(distrib_optimizer.DistributedOptimizer)
    optimizer.buffers = ddp.buffers
    optimizer.gbuf_ranges = [distrib_optimizer.DistributedOptimizer._build_gbuf_range_map(b) for b in ddp.buffers]
    optimizer.data_parallel_group = ps.get_data_parallel_group()  # one gloo rank: the all-gather is a copy
    optimizer.data_parallel_group_gloo = None
    optimizer.optimizer = None
    g = torch.Generator().manual_seed(0)
    states = {
        p: {k: torch.randn(p.numel(), generator=g) for k in ("param", "exp_avg", "exp_avg_sq")}
        for p in module.parameters()
    }
    optimizer._get_main_param_and_optimizer_states = lambda p: states[p]
    return optimizer, dict(module.named_parameters()), states


def test_fully_reshardable_saves_later_buckets_state_at_the_wrong_offsets_until_laid_out(model_parallel, monkeypatch):
    """megatron-core's own ``get_parameter_state_dp_zero`` and ``sharded_param_state_fully_reshardable`` (the
    backend's ``torch_dist`` optimizer layout) over real DDP buffers of three padded buckets: unpatched, every
    parameter past the first bucket saves other elements than its own main weights and moments (the tail
    zero-filled); with the workaround each saves exactly its own (copies: exact), and megatron-core's
    ``load_parameter_state_from_fully_reshardable`` hands every parameter back its own."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    optimizer, params, states = _bucketed_optimizer()
    sharded = {name: ShardedTensor.from_rank_offsets(name, p, replica_id=0) for name, p in params.items()}
    first = {p for p, (start, end, bucket) in optimizer.buffers[0].param_index_map.items() if bucket == 0}

    def saved():
        out = optimizer.sharded_param_state_fully_reshardable(sharded, is_loading=False, metadata={})
        return {
            params[s["param"].key.rsplit(".", 1)[-1]]: {k: t.data.flatten() for k, t in s.items()}
            for s in out.values()
        }, out

    cls = distrib_optimizer.DistributedOptimizer
    monkeypatch.setattr(cls, "sharded_param_state_fully_reshardable", megatron_compat.original_fully_reshardable())
    assert megatron_compat.WORKAROUNDS[-1].present()
    plain, _ = saved()
    for p, state in plain.items():
        same = all(torch.equal(state[k], states[p][k]) for k in states[p])
        assert same == (p in first), "megatron-core saves the later buckets right now: drop the workaround"
    monkeypatch.undo()  # back to the wrapped method (the fixture applied the workarounds)
    megatron_compat.apply_no_te_workarounds()
    fixed, out = saved()
    assert set(fixed) == set(states)
    for p, state in fixed.items():
        for k in states[p]:
            assert torch.equal(state[k], states[p][k]), k
    # The load's template (empty world tensors) goes through the wrapper too: each parameter's own shape.
    template = optimizer.sharded_param_state_fully_reshardable(sharded, is_loading=True, metadata={})
    assert {s["param"].key: s["param"].data.shape for s in template.values()} == {
        s["param"].key: s["param"].data.shape for s in out.values()
    }
    loaded = {}
    optimizer._set_main_param_and_optimizer_states = lambda p, tensors: loaded.update({p: tensors})
    optimizer.load_parameter_state_from_fully_reshardable(
        {i: {k: t.data for k, t in s.items()} for i, s in out.items()}
    )
    assert set(loaded) == set(states)
    for p, tensors in loaded.items():
        for k in states[p]:
            assert torch.equal(tensors[k], states[p][k]), k
