"""--sequence-parallel under --train-backend megatron without Transformer Engine or Apex: the backend's torch norms
(:mod:`runtime.train.backends.megatron_layers`), which of them sum their gradients over the tensor-parallel ranks, what
the flag checks refuse, and TP=2 with sequence parallelism over gloo (two processes) against TP=1 through a train step:
a dense Qwen3, a Qwen3-MoE (experts whole on both ranks, each rank's sequence chunk routed to them, and split over
EP=2) and the DeepSeek-V3 layout (multi-latent attention, a shared expert, the first layer dense)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from rlcore import keys  # noqa: E402
from runtime.train.backends import megatron_config as mc  # noqa: E402
from runtime.train.backends.megatron_layers import (  # noqa: E402
    LatentNorm,
    SequenceParallelNorm,
    WholeSequenceNorm,
    decoder_spec,
    torch_norm,
)
from runtime.train.backends.megatron_mla import HF_LATENT_NORM_EPS  # noqa: E402
from runtime.train.backends.megatron_step import sums_over_tensor_parallel  # noqa: E402


def _config(**overrides) -> TransformerConfig:
    settings = dict(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm")
    return TransformerConfig(**{**settings, **overrides})


def _reference(x: torch.Tensor, norm: torch.nn.Module, normalization: str) -> torch.Tensor:
    """The norm in float64 from its formula."""
    x = x.double()
    if normalization == "RMSNorm":
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
        return out * norm.weight.double()
    centred = x - x.mean(-1, keepdim=True)
    out = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + norm.eps)
    return out * norm.weight.double() + norm.bias.double()


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_norms_compute_torchs_norm_and_mark_only_what_sees_a_sequence_chunk(normalization, sequence_parallel):
    tp = dict(tensor_model_parallel_size=2, sequence_parallel=True) if sequence_parallel else {}
    config = _config(normalization=normalization, **tp)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 8, generator=gen)
    built = {
        SequenceParallelNorm: SequenceParallelNorm(config, 8, eps=1e-5),
        WholeSequenceNorm: WholeSequenceNorm(config, 8, eps=1e-5),
        LatentNorm: LatentNorm(config, 8, eps=1e-2),
    }
    for kind, norm in built.items():
        assert isinstance(norm, {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}[normalization])
        with torch.no_grad():
            for p in norm.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        # float32 against float64: a mean of 8 squares and a reciprocal square root, a few ulps of values of order 1.
        torch.testing.assert_close(norm(x).double(), _reference(x, norm, normalization), rtol=1e-5, atol=1e-5)
        marked = {getattr(p, "sequence_parallel", False) for p in norm.parameters()}
        # The hidden-state and latent norms see this rank's chunk of the sequence; the QK-norms the whole sequence.
        assert marked == {sequence_parallel and kind is not WholeSequenceNorm}, kind
    assert built[LatentNorm].eps == HF_LATENT_NORM_EPS  # transformers' latent epsilon, whatever the spec passes


def test_the_norms_refuse_what_needs_apex_or_transformer_engine():
    with pytest.raises(ValueError, match="zero-centred gamma"):
        torch_norm(_config(layernorm_zero_centered_gamma=True), 8, eps=1e-5, sequence_chunk=True)
    with pytest.raises(ValueError, match="normalization 'L2Norm'"):
        torch_norm(dataclasses.replace(_config(), normalization="L2Norm"), 8, eps=1e-5, sequence_chunk=True)


def _spec_norms(spec, prefix: str = "") -> dict[str, type]:
    """Every ``*norm*`` entry of a layer spec that builds a norm (not ``IdentityOp``), by its path."""
    from megatron.core.transformer.identity_op import IdentityOp

    out = {}
    submodules = getattr(spec, "submodules", None)
    if submodules is None or not dataclasses.is_dataclass(submodules):
        return out
    for field in dataclasses.fields(submodules):
        value = getattr(submodules, field.name)
        if "norm" in field.name and isinstance(value, type):
            if value is not IdentityOp:
                out[prefix + field.name] = value
        else:
            out.update(_spec_norms(value, f"{prefix}{field.name}."))
    return out


def test_every_norm_of_every_family_is_one_that_takes_sequence_parallelism():
    """Each family's decoder spec builds only the backend's norms, the QK-norms unmarked and the rest marked (a norm
    left to megatron-core would refuse --sequence-parallel when built)."""
    from test_megatron_deepseek_v3 import deepseek_config
    from test_megatron_glm4_moe import glm4_moe_config
    from test_megatron_mapping import hf_config
    from test_megatron_moe import qwen3_moe_config

    want = {
        "input_layernorm": SequenceParallelNorm,
        "pre_mlp_layernorm": SequenceParallelNorm,
        "self_attention.q_layernorm": WholeSequenceNorm,
        "self_attention.k_layernorm": WholeSequenceNorm,
    }
    mla = {k: v for k, v in want.items() if k != "self_attention.k_layernorm"}
    mla.update({"self_attention.q_layernorm": LatentNorm, "self_attention.kv_layernorm": LatentNorm})
    configs = {
        "qwen3": (hf_config("qwen3").to_dict(), want),
        "llama": (hf_config("llama").to_dict(), {k: v for k, v in want.items() if "self_attention" not in k}),
        "qwen3_moe": (qwen3_moe_config().to_dict(), want),
        "glm4_moe": (glm4_moe_config(use_qk_norm=True).to_dict(), want),
        "deepseek_v3": (deepseek_config().to_dict(), mla),
    }
    for family, (hf, norms) in configs.items():
        block = decoder_spec(mc.shape_from_hf(hf), attention_backend="auto")
        assert block.layer_norm is SequenceParallelNorm, family  # the final norm
        for layer in block.layer_specs:
            assert _spec_norms(layer) == norms, family


def test_which_gradients_are_summed_over_tensor_parallel_ranks():
    """megatron-core's finalize_model_grads rule, which the CPU gradient path follows: marked parameters under
    sequence parallelism, QK-norms by name under qk_layernorm."""
    marked, plain = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    marked.sequence_parallel = True
    sp = _config(tensor_model_parallel_size=2, sequence_parallel=True)
    assert sums_over_tensor_parallel("decoder.final_layernorm.weight", marked, config=sp)
    assert not sums_over_tensor_parallel("decoder.final_layernorm.weight", marked, config=_config())
    assert not sums_over_tensor_parallel("decoder.layers.0.mlp.linear_fc1.weight", plain, config=sp)
    qk = "decoder.layers.0.self_attention.k_layernorm.weight"
    assert sums_over_tensor_parallel(qk, plain, config=_config(qk_layernorm=True))
    # MLA's latent q_layernorm without sequence parallelism: whole on every rank (the up projection's backward
    # all-reduces its input gradient), so not summed where qk_layernorm is off (DeepSeek-V3's config).
    assert not sums_over_tensor_parallel("decoder.layers.0.self_attention.q_layernorm.weight", plain, config=_config())


def test_moe_layers_at_tp2_need_sequence_parallelism():
    from test_megatron_moe import qwen3_moe_config

    shape = mc.shape_from_hf(qwen3_moe_config().to_dict())
    (problem,) = mc.parallel_problems(shape, tp_size=2, pp_size=1)
    assert problem == (
        "--tensor-model-parallel-size 2 with the MoE layers of config.json needs --sequence-parallel (megatron-core "
        "trains MoE layers over tensor-parallel ranks only with sequence parallelism)"
    )
    assert mc.parallel_problems(shape, tp_size=2, pp_size=1, sequence_parallel=True) == []
    assert mc.parallel_problems(shape, tp_size=1, pp_size=1) == []


# ------------------------------------------------------------------ TP=2 with sequence parallelism over gloo

VOCAB = 203


def _save(case: str, folder) -> str:
    from test_megatron_backend import save_model
    from test_megatron_deepseek_v3 import deepseek_model
    from test_megatron_moe import save_qwen3_moe

    if case == "qwen3":
        return save_model("qwen3", folder, num_attention_heads=4, num_key_value_heads=2)
    if case.startswith("qwen3_moe"):
        return save_qwen3_moe(folder)
    deepseek_model(**({"first_k_dense_replace": 2} if case.endswith("dense") else {})).save_pretrained(folder)
    return str(folder)


# case -> (whether R2 (--use-routing-replay) runs: the old-log-prob pass records each rank's sequence chunk of routes,
# gathered whole, and the update replays each rank's chunk; the TP=2 run's other flags).
CASES = {
    "qwen3": (False, {}),
    "qwen3_moe": (True, {}),
    "deepseek_v3": (True, {}),
    "qwen3_moe_ep2": (True, {"expert_model_parallel_size": 2}),
    # MLA at TP=2 without sequence parallelism (its layers dense): the key's rotary gradient summed over the ranks
    # (megatron_compat.whole_latent_mla_attention) holds there too.
    "deepseek_v3_dense": (False, {"sequence_parallel": False}),
}
# The default suite's cases: a Qwen3-MoE (attention, QK-norms, norms, router and experts: what sequence parallelism
# changes in a Qwen3) and the DeepSeek-V3 layout (MLA's latent norms, a shared expert, expert biases); the dense Qwen3,
# EP=2 and MLA without sequence parallelism run with the slow cases (test_sp_slow_cases).
DEFAULT_CASES = ("qwen3_moe", "deepseek_v3")
SLOW_CASES = ("qwen3", "qwen3_moe_ep2", "deepseek_v3_dense")
TP2 = dict(tensor_model_parallel_size=2, sequence_parallel=True, actor_num_gpus_per_node=2)


def _job(tmp, case: str, *, tp2: bool):
    from test_megatron_backend import job

    replay, flags = CASES[case]
    cfg = job(tmp, train_backend="megatron", use_kl_loss=False, **({**TP2, **flags} if tp2 else {}))
    return dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, use_routing_replay=replay))


def _run(case: str, path: str, tmp, **kw) -> dict:
    """Log-probs (with R2's recorded routes), one train step's metrics, every tensor's gradient after it (Megatron
    names, this rank's part) and the exported weights."""
    from test_megatron_backend import make_batch, train_once, trainer

    from runtime.train.hooks import train_hooks
    from runtime.train.roles import ACTOR

    cfg = _job(tmp, case, tp2="rank" in kw)
    backend = trainer("megatron", path, cfg, roles=(ACTOR,), hooks=train_hooks(cfg), **kw)
    try:
        td = make_batch(VOCAB)
        log_probs = backend.compute_log_probs(td)
        metrics = train_once(backend, cfg, td)
        return dict(
            log_probs=log_probs,
            metrics=metrics,
            grads=tensor_grads(backend),
            weights=backend.get_weights(),
            sp=backend._module(backend.model).config.sequence_parallel,
        )
    finally:
        backend.shutdown()


def tensor_grads(backend) -> dict[str, torch.Tensor]:
    """Every tensor's gradient of the actor after a step, by Megatron name (a buffer, the expert bias: its value)."""
    from runtime.train.backends import megatron_moe as mmoe

    tensors = mmoe.model_tensors(backend._module(backend.model))
    return {n: (t if t.grad is None else t.grad).detach().clone() for n, t in tensors.items()}


def assert_hf_grads_equal(ranks: list[dict], one: dict, shape, *, what: str) -> None:
    """The TP ranks' gradients (``ranks``, EP=1) joined as the export joins weights equal TP=1's (``one``), HF-named.
    float32, the same sums in other orders: relative to each tensor's largest entry."""
    from runtime.train.backends import megatron_weights as mw

    got, want = mw.to_hf([ranks], shape), mw.to_hf([[one]], shape)
    for name, value in want.items():
        scale = float(value.abs().max()) or 1.0
        torch.testing.assert_close(
            got[name], value, rtol=1e-4, atol=1e-4 * scale, msg=lambda m, n=name: f"{what} {n}: {m}"
        )


def _sp_worker(rank, ports, cases, paths, tmp, out):
    for case, port in zip(cases, ports, strict=True):  # a rendezvous of its own for each trainer
        result = _run(case, paths[case], tmp, rank=rank, world_size=2, master_port=port)
        torch.save(result, f"{out}.{case}.{rank}")


def _spawn(cases, tmp_path, ranks) -> dict:
    """TP=2 runs of ``cases`` on the two gloo ``ranks`` (conftest's ``gloo_ranks``), then TP=1's here."""
    from test_megatron_backend import _free_port

    paths = {case: _save(case, tmp_path / case) for case in cases}
    out = str(tmp_path / "sp")
    ports = [_free_port() for _ in cases]
    ranks.run(_sp_worker, ports, tuple(cases), paths, tmp_path, out)
    tp1 = {case: _run(case, paths[case], tmp_path) for case in cases}
    tp2 = {case: [torch.load(f"{out}.{case}.{r}", weights_only=False) for r in range(2)] for case in cases}
    return {case: (tp2[case], tp1[case], paths[case]) for case in cases}


@pytest.fixture(scope="module")
def default_cases(tmp_path_factory, gloo_ranks):
    return _spawn(DEFAULT_CASES, tmp_path_factory.mktemp("sp"), gloo_ranks)


def _check(case: str, ranks: list[dict], one: dict, path: str) -> None:
    from test_megatron_backend import make_batch

    from runtime.train.backends.megatron_build import _read_shape
    from runtime.train.batch import PROMPT_LENGTHS, RESPONSE_LENGTHS, ROUTED_EXPERTS

    sequence_parallel = CASES[case][1].get("sequence_parallel", True)
    assert [r["sp"] for r in ranks] == [sequence_parallel] * 2 and not one["sp"]  # built as asked
    tokens = make_batch(VOCAB)
    mask = tokens[keys.MASK]
    # float32 both: the same products summed in other orders (the row-parallel projections' partial sums, reduced
    # and scattered), a few ulps of values of order 1 through two layers.
    for r in ranks:
        torch.testing.assert_close(
            r["log_probs"][keys.OLD_LOG_PROBS][mask], one["log_probs"][keys.OLD_LOG_PROBS][mask], rtol=1e-5, atol=2e-5
        )
    if ROUTED_EXPERTS in one["log_probs"]:
        lengths = (tokens[PROMPT_LENGTHS] + tokens[RESPONSE_LENGTHS]).tolist()
        for r in ranks:
            for row, length in enumerate(lengths):
                # Every real token's recorded experts, gathered over the two sequence chunks, are TP=1's.
                got = r["log_probs"][ROUTED_EXPERTS][row, :length]
                assert torch.equal(got, one["log_probs"][ROUTED_EXPERTS][row, :length]), (case, row)
    for name in ("loss", "pg_loss", "grad_norm"):
        assert ranks[0]["metrics"][name] == pytest.approx(one["metrics"][name], rel=1e-4, abs=1e-6), (case, name)
    # The TP-replicated tensors (norms, routers: whole on each rank) hold the full sequence's gradient on every rank:
    # summed over the ranks' sequence chunks, not one chunk's share. float32, sums in other orders: relative to the
    # tensor's largest entry.
    shape = _read_shape(path)
    for name, want in one["grads"].items():
        if any(part in name for part in ("norm", "router")):
            for r in ranks:
                scale = float(want.abs().max()) or 1.0
                torch.testing.assert_close(
                    r["grads"][name], want, rtol=1e-4, atol=1e-4 * scale, msg=lambda m, n=name: f"{case} {n}: {m}"
                )
    if "expert_model_parallel_size" not in CASES[case][1]:
        assert_hf_grads_equal([r["grads"] for r in ranks], one["grads"], shape, what=case)
    for name, value in one["weights"].items():
        # One Adam step of lr 1e-3 from equal weights and gradients equal to float32 rounding.
        torch.testing.assert_close(
            ranks[0]["weights"][name], value, rtol=0, atol=2e-5, msg=lambda m, n=name: f"{case} {n}: {m}"
        )


@pytest.mark.parametrize("case", DEFAULT_CASES)
def test_sp_at_tp2_trains_as_tp1(case, default_cases):
    """TP=2 with --sequence-parallel against TP=1: log-probs, R2's recorded routes, loss, gradient norm, every
    gradient (the norms' and routers' on each rank the full sequence's) and the weights after one step."""
    _check(case, *default_cases[case])


@pytest.mark.slow  # three more models on the two ranks, and their TP=1 runs: a minute or more on two loaded cores
def test_sp_slow_cases(tmp_path, gloo_ranks):
    """As :func:`test_sp_at_tp2_trains_as_tp1` for a dense Qwen3, a Qwen3-MoE whose experts are split over EP=2 on the
    TP ranks (every gradient but the experts', which the ranks hold by their own local ids) and the DeepSeek-V3 layout
    at TP=2 without sequence parallelism (its layers dense)."""
    results = _spawn(SLOW_CASES, tmp_path, gloo_ranks)
    for case, (ranks, one, path) in results.items():
        _check(case, ranks, one, path)
