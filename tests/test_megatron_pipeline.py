"""Pipeline parallelism under --train-backend megatron, on the CPU over gloo: how the decoder layers split into stages
(equal, or uneven with --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers, Megatron's meanings),
against megatron-core's own stage arithmetic; the HF <-> Megatron mapping over uneven stages; and PP=2 (Megatron's
1F1B schedule and point-to-point sends over gloo, two processes) against PP=1 through a train step, a MoE model's
balancing loss (global_aux_loss) and its metric included."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("megatron.core")

from rlcore import keys  # noqa: E402
from runtime.train.backends import megatron_config as mc  # noqa: E402
from runtime.train.backends import megatron_weights as mw  # noqa: E402


def _megatron_stages(num_layers: int, pp: int, first: int | None, last: int | None) -> tuple[int, ...] | None:
    """Each stage's layer count as megatron-core 0.16.1 computes it (its config check, layer offset and count), or
    None where its TransformerConfig refuses the split."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    try:
        config = TransformerConfig(
            num_layers=num_layers,
            hidden_size=8,
            num_attention_heads=2,
            pipeline_model_parallel_size=pp,
            num_layers_in_first_pipeline_stage=first,
            num_layers_in_last_pipeline_stage=last,
            pipeline_dtype=torch.float32,
        )
        sizes = tuple(get_num_layers_to_build(config, pp_rank=r) for r in range(pp))
    except (ValueError, AssertionError):  # its config check, or its equal split's divisibility assertion
        return None
    if min(sizes) <= 0:
        return None  # megatron-core checks only the signs of the given depths: a stage left with no or fewer layers
    offsets = [get_transformer_layer_offset(config, pp_rank=r) for r in range(pp)]
    assert offsets == [sum(sizes[:r]) for r in range(pp)]  # the stages follow each other
    return sizes


@settings(max_examples=150, deadline=None)
@given(
    num_layers=st.integers(1, 40),
    pp=st.integers(2, 8),
    first=st.none() | st.integers(0, 12),
    last=st.none() | st.integers(0, 12),
)
def test_stage_sizes_are_megatron_cores(num_layers, pp, first, last):
    """Where megatron-core builds the split, the backend's stage sizes are its sizes; where it refuses (or where its
    equal split would drop layers), the backend refuses with a message naming the flag."""
    want = _megatron_stages(num_layers, pp, first, last)
    if want is None:
        with pytest.raises(ValueError, match="--(pipeline-model-parallel-size|decoder-(first|last)-pipeline)"):
            mc.pipeline_stage_sizes(num_layers, pp_size=pp, first=first, last=last)
    else:
        assert mc.pipeline_stage_sizes(num_layers, pp_size=pp, first=first, last=last) == want


def test_stage_layers_follow_the_stage_depths_and_the_messages_name_the_flags():
    shape = dataclasses.replace(_shape(num_hidden_layers=61), first_stage_layers=7, last_stage_layers=6)
    stages = [mc.stage_layers(shape, pp_rank=r, pp_size=8) for r in range(8)]  # DeepSeek-R1's slime split
    assert [len(s) for s in stages] == [7, 8, 8, 8, 8, 8, 8, 6]
    assert [i for s in stages for i in s] == list(range(61))
    assert mc.parallel_problems(shape, tp_size=1, pp_size=8) == []
    (problem,) = mc.parallel_problems(_shape(num_hidden_layers=61), tp_size=1, pp_size=8)
    assert problem == (
        "--pipeline-model-parallel-size 8 must split the 61 decoder layers equally over its stages (or set "
        "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers) (num_hidden_layers 61 of "
        "config.json)"
    )
    (problem,) = mc.parallel_problems(dataclasses.replace(shape, last_stage_layers=5), tp_size=1, pp_size=8)
    assert "the 6 stages besides --decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers" in problem
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 1 has one stage"):
        mc.pipeline_stage_sizes(4, pp_size=1, first=1, last=3)
    with pytest.raises(ValueError, match="--decoder-last-pipeline-num-layers must be > 0, got 0"):
        mc.pipeline_stage_sizes(4, pp_size=2, last=0)


def test_a_stage_without_moe_layers_is_refused_naming_the_stage_flags():
    """GLM-4.5's first layer is dense: a first stage of that layer alone would leave megatron-core's optimizer without
    an expert part there, which the other stages' expert gradient norm waits on (a hang on GPUs; the CPU path, which
    did the same, hung a gloo rank for its 10-minute timeout before the fix beside this refusal)."""
    from test_megatron_glm4_moe import glm4_moe_config

    shape = mc.shape_from_hf(glm4_moe_config(num_hidden_layers=3).to_dict())
    assert shape.moe.layer_pattern == (0, 1, 1)
    (problem,) = mc.parallel_problems(dataclasses.replace(shape, first_stage_layers=1), tp_size=1, pp_size=2)
    assert problem.startswith("pipeline stage 0 holds decoder layers 0-0 of config.json, none of them MoE")
    assert "--decoder-first-pipeline-num-layers" in problem
    # Stages of 2 and 1 layers, or 1 MoE-holding stage each way on 4 layers: accepted.
    assert mc.parallel_problems(dataclasses.replace(shape, first_stage_layers=2), tp_size=1, pp_size=2) == []
    four = mc.shape_from_hf(glm4_moe_config(num_hidden_layers=4).to_dict())
    assert mc.parallel_problems(four, tp_size=1, pp_size=2) == []


def test_the_transformer_config_and_layer_specs_take_the_stage_depths(tmp_path):
    """megatron-core numbers a stage's layers (routing replay's slots, checkpoint keys) from its config's stage depths,
    and builds as many layers as the stage's spec lists: both must follow the flags."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from test_megatron_backend import job

    from runtime.train.backends.megatron_build import transformer_config
    from runtime.train.backends.megatron_layers import decoder_spec

    flags = dict(decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=2)
    cfg = job(tmp_path, train_backend="megatron", pipeline_model_parallel_size=3, actor_num_gpus_per_node=3, **flags)
    shape = dataclasses.replace(_shape(num_hidden_layers=6), first_stage_layers=1, last_stage_layers=2)
    config = transformer_config(shape, cfg.train, bf16=False, cpu=True)
    assert [get_transformer_layer_offset(config, pp_rank=r) for r in range(3)] == [0, 1, 4]
    specs = [decoder_spec(shape, attention_backend="auto", pp_rank=r, pp_size=3).layer_specs for r in range(3)]
    assert [len(s) for s in specs] == [1, 3, 2]


def _shape(**overrides) -> mc.ModelShape:
    from test_megatron_mapping import hf_config

    return mc.shape_from_hf(hf_config("qwen3", **overrides).to_dict())


@pytest.mark.parametrize(("layers", "first", "last"), [(3, 1, None), (3, None, 1), (5, 1, 1), (5, 2, 3)])
def test_uneven_stages_map_every_hf_tensor_once_and_back(layers, first, last):
    """Every stage of an uneven split takes its own layers' HF tensors (renumbered from 0) and the export joins the
    stages back into the same state dict, bitwise (the mapping only copies and splits)."""
    from test_megatron_mapping import hf_config, hf_state

    config = hf_config("qwen3", num_hidden_layers=layers)
    shape = dataclasses.replace(mc.shape_from_hf(config.to_dict()), first_stage_layers=first, last_stage_layers=last)
    hf = hf_state(config)
    pp = 3 if layers == 5 and first and last and first + last < 5 else 2
    shards = [[mw.to_megatron(hf, shape, tp_rank=0, tp_size=1, pp_rank=r, pp_size=pp)] for r in range(pp)]
    sizes = mc.pipeline_stage_sizes(layers, pp_size=pp, first=first, last=last)
    for stage, size in zip(shards, sizes, strict=True):
        numbers = {int(n.split(".")[2]) for n in stage[0] if n.startswith("decoder.layers.")}
        assert numbers == set(range(size))
        # The stage's layer 0 is its first global layer: the HF tensor of that layer, not of layer 0.
    start = sum(sizes[:-1])
    key = "decoder.layers.0.self_attention.linear_proj.weight"
    assert torch.equal(shards[-1][0][key], hf[f"model.layers.{start}.self_attn.o_proj.weight"])
    back = mw.to_hf(shards, shape)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


# ------------------------------------------------------------------ PP=2 over gloo against PP=1

VOCAB = 203
# case -> (the model: (family, num_hidden_layers), the PP=2 run's stage flags, whether R2 (--use-routing-replay) runs,
# the flags of both runs)
CASES = {
    # Tied embeddings (Qwen3's tiny config): the two copies' gradients summed over the stages.
    "qwen3_uneven": (
        ("qwen3", 3),
        dict(decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=2),
        False,
        {},
    ),
    "qwen3_even": (("qwen3", 4), {}, False, {}),
    # Routing replay's slots by global layer number: each stage records and replays its own layers' routes.
    "qwen3_moe_uneven": (("qwen3_moe", 3), dict(decoder_last_pipeline_num_layers=2), True, {}),
    # The balancing loss (global_aux_loss: each micro-batch against the step's running counts) rides on each stage's
    # own routers' outputs through megatron-core's MoEAuxLossAutoScaler, scaled by the 1F1B schedule; each stage
    # records its own layers' losses, summed over the stages into the metric. A coefficient of 1 makes it the larger
    # part of the routers' gradients, so a wrong scale shows through the tolerance.
    "qwen3_moe_global_aux": (
        ("qwen3_moe", 3),
        dict(decoder_first_pipeline_num_layers=1),
        False,
        dict(moe_aux_loss_coeff=1.0, moe_router_load_balancing_type="global_aux_loss"),
    ),
}
DEFAULT_CASES = ("qwen3_uneven", "qwen3_moe_global_aux")
SLOW_CASES = ("qwen3_even", "qwen3_moe_uneven")


def _save(case: str, folder) -> str:
    from test_megatron_backend import save_model
    from test_megatron_moe import save_qwen3_moe

    (family, layers), *_ = CASES[case]
    if family == "qwen3_moe":
        return save_qwen3_moe(folder, num_hidden_layers=layers)
    return save_model("qwen3", folder, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=layers)


def _job(tmp, case: str, *, pp2: bool):
    from test_megatron_backend import job

    _, flags, replay, both = CASES[case]
    pp = dict(pipeline_model_parallel_size=2, actor_num_gpus_per_node=2, **flags) if pp2 else {}
    cfg = job(tmp, train_backend="megatron", use_kl_loss=False, **both, **pp)
    return dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, use_routing_replay=replay))


def _run(case: str, path: str, tmp, *, save: str | None = None, **kw) -> dict:
    """Log-probs, one train step's metrics, every tensor's gradient after it (this stage's, Megatron names) and the
    exported weights; with ``save``, the trainer's checkpoint (weights only) written there after the step."""
    from test_megatron_backend import make_batch, train_once, trainer
    from test_megatron_sequence_parallel import tensor_grads

    from runtime.train.hooks import train_hooks
    from runtime.train.roles import ACTOR

    cfg = _job(tmp, case, pp2="rank" in kw)
    backend = trainer("megatron", path, cfg, roles=(ACTOR,), hooks=train_hooks(cfg), **kw)
    try:
        td = make_batch(VOCAB)
        log_probs = backend.compute_log_probs(td)
        metrics = train_once(backend, cfg, td)
        if save is not None:
            backend.save(save, with_optimizer=False)
        return dict(
            log_probs=log_probs,
            metrics=metrics,
            grads=tensor_grads(backend),
            weights=backend.get_weights(),
            stage=(backend.pp_rank, backend.pp),
            shape=backend.shape,
        )
    finally:
        backend.shutdown()


def _pp_worker(rank, ports, cases, paths, tmp, out):
    for case, port in zip(cases, ports, strict=True):  # a rendezvous of its own for each trainer
        result = _run(case, paths[case], tmp, save=f"{out}.{case}.ckpt", rank=rank, world_size=2, master_port=port)
        torch.save(result, f"{out}.{case}.{rank}")


def _loaded_at_pp1(case: str, path: str, tmp, folder: str) -> dict[str, torch.Tensor]:
    """The exported weights of a PP=1 trainer that loads the PP=2 trainer's checkpoint ``folder``."""
    from test_megatron_backend import trainer

    from runtime.train.hooks import train_hooks
    from runtime.train.roles import ACTOR

    cfg = _job(tmp, case, pp2=False)
    backend = trainer("megatron", path, cfg, roles=(ACTOR,), hooks=train_hooks(cfg))
    try:
        backend.load(folder)
        return backend.get_weights()
    finally:
        backend.shutdown()


def _spawn(cases, tmp_path, ranks) -> dict:
    """PP=2 runs of ``cases`` on the two gloo ``ranks`` (conftest's ``gloo_ranks``), then PP=1's here."""
    from test_megatron_backend import _free_port

    paths = {case: _save(case, tmp_path / case) for case in cases}
    out = str(tmp_path / "pp")
    ranks.run(_pp_worker, [_free_port() for _ in cases], tuple(cases), paths, tmp_path, out)
    pp1 = {case: _run(case, paths[case], tmp_path) for case in cases}
    pp2 = {case: [torch.load(f"{out}.{case}.{r}", weights_only=False) for r in range(2)] for case in cases}
    loaded = {case: _loaded_at_pp1(case, paths[case], tmp_path, f"{out}.{case}.ckpt") for case in cases}
    return {case: (pp2[case], pp1[case], loaded[case]) for case in cases}


def _check(case: str, stages: list[dict], one: dict, loaded: dict[str, torch.Tensor]) -> None:
    from test_megatron_backend import make_batch

    from runtime.train.batch import PROMPT_LENGTHS, RESPONSE_LENGTHS, ROUTED_EXPERTS

    (_, layers), flags, _, both = CASES[case]
    assert [s["stage"] for s in stages] == [(0, 2), (1, 2)]
    shape = stages[0]["shape"]
    sizes = [len(mc.stage_layers(shape, pp_rank=r, pp_size=2)) for r in range(2)]
    first, last = flags.get("decoder_first_pipeline_num_layers"), flags.get("decoder_last_pipeline_num_layers")
    assert sizes == [first or layers - (last or layers // 2), last or layers - (first or layers // 2)]
    tokens = make_batch(VOCAB)
    mask = tokens[keys.MASK]
    # float32 both: the same layers on the same inputs, the activations handed between stages as float32 tensors
    # (pipeline_dtype); only the order of the last stage's sums may differ, a few ulps of values of order 1.
    for s in stages:
        torch.testing.assert_close(
            s["log_probs"][keys.OLD_LOG_PROBS][mask], one["log_probs"][keys.OLD_LOG_PROBS][mask], rtol=1e-5, atol=2e-5
        )
    if ROUTED_EXPERTS in one["log_probs"]:
        lengths = (tokens[PROMPT_LENGTHS] + tokens[RESPONSE_LENGTHS]).tolist()
        assert all(shape.moe.layer_pattern)  # every layer MoE: the routes' layer axis is the decoder layer's
        for r, s in enumerate(stages):
            own = list(mc.stage_layers(shape, pp_rank=r, pp_size=2))
            for row, length in enumerate(lengths):
                # Every real token's recorded experts in the stage's own layers are PP=1's (the other stages' layers
                # hold dummy experts: each stage replays its own).
                got = s["log_probs"][ROUTED_EXPERTS][row, :length, own]
                assert torch.equal(got, one["log_probs"][ROUTED_EXPERTS][row, :length, own]), (case, r, row)
    names = ("loss", "pg_loss", "grad_norm", *(("moe_aux_loss",) if both.get("moe_aux_loss_coeff") else ()))
    for name in names:
        for s in stages:
            assert s["metrics"][name] == pytest.approx(one["metrics"][name], rel=1e-4, abs=1e-6), (case, name)
    # Every gradient, the stages' joined by the export's mapping (a tied embedding's from the first stage, after the
    # sum with the last stage's copy). float32, sums in other orders: relative to each tensor's largest entry.
    got = mw.to_hf([[s["grads"]] for s in stages], shape)
    want = mw.to_hf([[one["grads"]]], one["shape"])
    assert set(got) == set(want)
    for name, value in want.items():
        scale = float(value.abs().max()) or 1.0
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-4 * scale, msg=lambda m, n=name: f"{n}: {m}")
    if shape.tie_embeddings:
        # The last stage's copy of the embedding took the same summed gradient.
        head = stages[1]["grads"]["output_layer.weight"][:VOCAB]
        torch.testing.assert_close(head, stages[0]["grads"]["embedding.word_embeddings.weight"][:VOCAB])
    assert stages[1]["weights"] is None  # the export gathers every stage's tensors on global rank 0
    assert set(stages[0]["weights"]) == set(one["weights"])
    for name, value in one["weights"].items():
        # One Adam step of lr 1e-3 from equal weights and gradients equal to float32 rounding.
        got = stages[0]["weights"][name]
        torch.testing.assert_close(got, value, rtol=0, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
    # The checkpoint saved over the stages (each layer under its global number) loads at PP=1: the same float32 values.
    assert set(loaded) == set(stages[0]["weights"])
    for name, value in loaded.items():
        assert torch.equal(value, stages[0]["weights"][name]), name


@pytest.fixture(scope="module")
def default_cases(tmp_path_factory, gloo_ranks):
    return _spawn(DEFAULT_CASES, tmp_path_factory.mktemp("pp"), gloo_ranks)


@pytest.mark.parametrize("case", DEFAULT_CASES)
def test_pp2_trains_as_pp1(case, default_cases):
    """A 3-layer Qwen3 with tied embeddings, and a 3-layer Qwen3-MoE with --moe-aux-loss-coeff 1 (global_aux_loss),
    each over two uneven stages (1 and 2 layers) against PP=1: log-probs, loss, gradient norm, ``moe_aux_loss``, every
    gradient and the weights after one step; the checkpoint then loads at PP=1."""
    _check(case, *default_cases[case])


@pytest.mark.slow  # two more models on the two ranks and their PP=1 runs: a minute or more on two loaded cores
def test_pp2_slow_cases(tmp_path, gloo_ranks):
    """As :func:`test_pp2_trains_as_pp1` for equal stages (a 4-layer Qwen3, 2 and 2) and a 3-layer Qwen3-MoE with
    R2 routing replay over stages of 1 and 2 layers (each stage records and replays its own layers' routes)."""
    for case, results in _spawn(SLOW_CASES, tmp_path, gloo_ranks).items():
        _check(case, *results)


def test_the_converter_takes_the_stage_flags_as_layout(tmp_path):
    """slime's MODEL_ARGS carry the stage flags into its converter call: a torch_dist checkpoint is layout-free (each
    layer under its global number), so they are taken and neither noted as ignored nor refused."""
    from tools import convert_hf_to_megatron

    flags = ["--pipeline-model-parallel-size", "4", "--decoder-last-pipeline-num-layers", "13"]
    argv = ["--hf-checkpoint", str(tmp_path / "hf"), "--save", str(tmp_path / "out"), *flags]
    _, _, shape_flags, _, notes = convert_hf_to_megatron.parse(argv)
    assert notes == [] and shape_flags == {}
