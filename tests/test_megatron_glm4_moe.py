"""GLM-4.5 (``glm4_moe``) under --train-backend megatron on the CPU: config.json and slime's flags, the weights both
ways (shared expert, expert bias, the first layer dense), and megatron-core's model against transformers' on the same
weights in float32, with identical expert choices, at EP=1 and at EP=2 over gloo.

GLM-4.5's MoE differs from Qwen3-MoE's: a sigmoid router whose choice adds a per-expert bias (the gate weights are
the unbiased scores, renormalised over the top k and scaled by routed_scaling_factor), optionally within the best
groups of experts; a shared expert beside the routed ones; the first ``first_k_dense_replace`` layers dense. Its
attention: a bias on q/k/v, Llama's rotary pairs over half of each head, QK-norm as ``use_qk_norm`` says.
"""

from __future__ import annotations

import pytest
import torch
from test_megatron_moe import _routes, routed_logits, widen

from runtime.train.backends import megatron_config as mc
from runtime.train.backends import megatron_moe as moe
from runtime.train.backends import megatron_weights as mw
from runtime.train.batch import PROMPT_LENGTHS, RESPONSE_LENGTHS

GLM4_MOE = dict(
    vocab_size=203,
    hidden_size=48,
    intermediate_size=80,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    partial_rotary_factor=0.5,
    attention_bias=True,
    use_qk_norm=False,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    pad_token_id=0,
    tie_word_embeddings=False,
)
# float32 against float32: two implementations of one model sum in different orders (a few ulps of values of order 1,
# compounded over three layers); a token sent to another expert would differ by O(0.1).
LOGIT_TOL = dict(rtol=1e-5, atol=1e-5)
# Group-limited routing: 2 groups of 4 experts, a token's 2 experts from the best group (megatron-core scores a group
# by its top topk // topk_group = 2 experts, as transformers does); with QK-norm (GLM-4.5-355B's use_qk_norm).
GROUPED = dict(n_group=2, topk_group=1, use_qk_norm=True)


def glm4_moe_config(**overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model("glm4_moe", **{**GLM4_MOE, **overrides})


def glm4_moe_model(seed: int = 0, **overrides):
    """A random tiny GLM-4.5: routers drawn wide (distinct expert scores), expert biases large enough to change
    choices, norms away from one and q/k/v biases away from zero."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(glm4_moe_config(**overrides), dtype=torch.float32)
    return widen(model, norm_std=0.2, bias_std=0.2, expert_bias_std=0.3)


# ------------------------------------------------------------------ config.json and flags


def test_shape_reads_glm4_moe():
    shape = mc.shape_from_hf(glm4_moe_config().to_dict())
    assert shape.moe == moe.MoEShape(
        num_experts=8,
        router_topk=2,
        ffn_hidden_size=24,
        pre_softmax=False,
        layer_pattern=(0, 1, 1),
        score_function="sigmoid",
        shared_ffn_hidden_size=24,
        expert_bias=True,
        topk_scaling_factor=2.5,
    )
    assert shape.add_qkv_bias and not shape.qk_layernorm and shape.rotary_percent == 0.5
    assert not shape.rotary_interleaved and not shape.post_norms
    grouped = mc.shape_from_hf(glm4_moe_config(**GROUPED).to_dict())
    assert (grouped.moe.num_groups, grouped.moe.group_topk, grouped.qk_layernorm) == (2, 1, True)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"norm_topk_prob": False}, "norm_topk_prob false"),
        ({"num_experts_per_tok": 1}, "num_experts_per_tok 1"),
        (
            {"n_group": 2, "topk_group": 2},
            "megatron-core scores a group by its top 1 experts, transformers by its top 2",
        ),
    ],
)
def test_refuses_routers_megatron_computes_differently(fields, named):
    with pytest.raises(ValueError, match="cannot build this model") as err:
        mc.shape_from_hf(glm4_moe_config().to_dict() | fields, source="ckpt/config.json")
    assert named in str(err.value) and "ckpt/config.json" in str(err.value)


def test_slimes_glm45_flags_agree_or_are_named():
    shape = mc.shape_from_hf(glm4_moe_config().to_dict())
    # slime's scripts/models/glm4.5-106B-A12B.sh's MoE flags, at this model's sizes (it passes
    # --moe-router-pre-softmax with the sigmoid router, which megatron-core reads for softmax routers only).
    slime = dict(
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=24,
        moe_shared_expert_intermediate_size=24,
        moe_router_pre_softmax=True,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=2.5,
        moe_layer_freq="[0]*1+[1]*2",
        add_qkv_bias=True,
        rotary_percent=0.5,
    )
    assert mc.shape_flag_problems(slime, shape) == []
    problems = mc.shape_flag_problems(
        slime | dict(moe_shared_expert_intermediate_size=48, moe_router_topk_scaling_factor=1.0, moe_layer_freq=1),
        shape,
    )
    assert [p.split()[0] for p in problems] == [
        "--moe-layer-freq",
        "--moe-shared-expert-intermediate-size",
        "--moe-router-topk-scaling-factor",
    ], problems
    assert "first_k_dense_replace" in problems[0] and "routed_scaling_factor gives 2.5" in problems[2]


def test_model_name_picks_slimes_glm4moe_mapping():
    shape = mc.shape_from_hf(glm4_moe_config().to_dict())
    assert mc.weight_mapping(mc.default_model_name("glm4_moe"), shape) == "glm4_moe"
    with pytest.raises(ValueError, match="experts and router"):
        mc.weight_mapping("glm4", shape)


# ------------------------------------------------------------------ weights


def checkpoint_state(model) -> dict[str, torch.Tensor]:
    """The model's tensors under the checkpoint's per-expert names (the wire layout), as save_pretrained writes."""
    from runtime.engines.checkpoint_layout import CheckpointLayout

    return CheckpointLayout(model).state_dict(dict(model.state_dict()))


def _hf_state() -> dict[str, torch.Tensor]:
    return checkpoint_state(glm4_moe_model())


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 3)])
def test_weights_round_trip_exactly(tp, pp):
    hf = _hf_state()
    shape = mc.shape_from_hf(glm4_moe_config().to_dict())
    mw.check_hf_state(hf, shape)
    shards = [
        [mw.to_megatron(hf, shape, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp) for t in range(tp)] for p in range(pp)
    ]
    first = shards[0][0] if pp == 1 else shards[1][0]
    local = 1 if pp == 1 else 0
    assert torch.equal(
        first[f"decoder.layers.{local}.mlp.router.expert_bias"], hf["model.layers.1.mlp.gate.e_score_correction_bias"]
    )
    # The shared expert is split over TP ranks like a dense MLP: [gate; up] of this rank's rows.
    gate = hf["model.layers.1.mlp.shared_experts.gate_proj.weight"]
    up = hf["model.layers.1.mlp.shared_experts.up_proj.weight"]
    rows = 24 // tp
    fc1 = first[f"decoder.layers.{local}.mlp.shared_experts.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([gate[:rows], up[:rows]]))
    back = mw.to_hf(shards, shape)
    assert set(back) == set(hf)
    for name, value in hf.items():
        assert torch.equal(back[name], value), name


def test_expert_parallel_ranks_hold_their_experts():
    hf = _hf_state()
    shape = mc.shape_from_hf(glm4_moe_config().to_dict())
    for rank in range(2):
        shard = mw.to_megatron(hf, shape, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, ep_rank=rank, ep_size=2)
        for j in range(4):
            got = shard[f"decoder.layers.2.mlp.experts.local_experts.{j}.linear_fc2.weight"]
            assert torch.equal(got, hf[f"model.layers.2.mlp.experts.{4 * rank + j}.down_proj.weight"])
        # The router, its bias and the shared expert are whole on every EP rank; the dense layer has no experts.
        assert torch.equal(shard["decoder.layers.1.mlp.router.weight"], hf["model.layers.1.mlp.gate.weight"])
        assert "decoder.layers.0.mlp.linear_fc1.weight" in shard
        assert not any(n.startswith("decoder.layers.0.mlp.experts") for n in shard)


# ------------------------------------------------------------------ megatron-core's model

pytest.importorskip("megatron.core")


def _job(tmp_path, **overrides):
    from test_megatron_backend import job

    return job(tmp_path, train_backend="megatron", **overrides)


@pytest.mark.parametrize("fields", [{}, GROUPED], ids=["one-group", "grouped-qk-norm"])
def test_logits_and_expert_choices_equal_transformers(fields, tmp_path):
    from test_megatron_backend import make_batch, trainer

    from runtime.train.roles import ACTOR

    hf = glm4_moe_model(**fields)
    path = tmp_path / "glm4_moe"
    hf.save_pretrained(path)
    mega = trainer("megatron", str(path), _job(tmp_path), roles=(ACTOR,))
    try:
        logits, want, got_routes, want_routes = routed_logits(mega, hf, make_batch(203)[:5])
        assert len(got_routes) == len(want_routes) == 2  # the two MoE layers; the first is dense
        for got, expected in zip(got_routes, want_routes, strict=True):
            assert torch.equal(got, expected)
        torch.testing.assert_close(logits[..., :203], want, **LOGIT_TOL)
        exported, checkpoint = mega.get_weights(), checkpoint_state(hf)
        assert set(exported) == set(checkpoint)
        for name, value in checkpoint.items():
            assert torch.equal(exported[name], value), name
    finally:
        mega.shutdown()


def test_the_expert_bias_moves_by_megatrons_rule_after_a_step(tmp_path):
    """--moe-router-bias-update-rate r: after a step each expert's bias moves by +r where it got fewer tokens than
    the mean over experts, -r where more (counted from the training forward's routes of the real tokens,
    independently here); at 0 it stays the checkpoint's."""
    from test_megatron_backend import make_batch, train_once, trainer

    from runtime.train.roles import ACTOR

    hf = glm4_moe_model()
    path = tmp_path / "glm4_moe"
    hf.save_pretrained(path)
    rate = 0.01
    for r in (rate, 0.0):
        cfg = _job(tmp_path, moe_router_bias_update_rate=r, micro_batch_size=8, use_kl_loss=False)
        mega = trainer("megatron", str(path), cfg, roles=(ACTOR,))
        try:
            before = {
                n: b.clone() for n, b in moe.model_tensors(mega._module(mega.model)).items() if "expert_bias" in n
            }
            routes = []
            hooks = _routes(mega.model, routes)
            td = make_batch(203)
            train_once(mega, cfg, td)
            for hook in hooks:
                hook.remove()
            after = {n: b for n, b in moe.model_tensors(mega._module(mega.model)).items() if "expert_bias" in n}
            # The forwards with gradients are the step's (compute_log_probs runs without): the last two maps, of the
            # one micro-batch's real tokens (each row's right padding is routed but not counted).
            seq = td[PROMPT_LENGTHS] + td[RESPONSE_LENGTHS]
            real = ~moe.padding_mask(seq, int(seq.max())).reshape(-1, 1)
            counts = [(m & real).sum(0).double() for m in routes[-2:]]
            for (name, old), count in zip(sorted(before.items()), counts, strict=True):
                want = old.double() + torch.sign(count.mean() - count) * r
                torch.testing.assert_close(after[name].double(), want, rtol=0, atol=1e-7)
        finally:
            mega.shutdown()


def _ep_worker(rank, port, path, tmp, out):
    from test_megatron_backend import make_batch, trainer

    from runtime.train.roles import ACTOR

    cfg = _job(tmp, expert_model_parallel_size=2, actor_num_gpus_per_node=2)
    mega = trainer("megatron", path, cfg, rank=rank, world_size=2, master_port=port, roles=(ACTOR,))
    try:
        mb = make_batch(203)[4 * rank : 4 * rank + 4]
        with mega._shims(), torch.no_grad():
            logits = mega._logits(mega.model, mb)[..., :203].clone()
            tokens, _, _ = mega._inputs(mb)
        torch.save({"logits": logits, "tokens": tokens}, f"{out}.{rank}")
    finally:
        mega.shutdown()


def test_expert_parallel_two_ranks_equal_transformers(tmp_path, gloo_ranks):
    """EP=2 over gloo (two processes, each with half the experts and half the rows, tokens sent to the other rank's
    experts and back) gives transformers' logits, as EP=1 does above."""
    from test_megatron_backend import _free_port

    hf = glm4_moe_model(**GROUPED)
    path = tmp_path / "glm4_moe"
    hf.save_pretrained(path)
    out = str(tmp_path / "ep2.pt")
    gloo_ranks.run(_ep_worker, _free_port(), str(path), tmp_path, out)
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        with torch.no_grad():
            want = hf(input_ids=got["tokens"]).logits
        torch.testing.assert_close(got["logits"], want, **LOGIT_TOL)


def test_the_decoder_spec_lists_each_stages_own_layers():
    """Dense first layers make a block spec of the stage's layers in order (equal pipeline stages); a uniform stack is
    a block spec too, of one layer spec repeated (its final norm is the backend's, megatron_layers)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from runtime.train.backends.megatron_layers import decoder_spec

    shape = mc.shape_from_hf(glm4_moe_config(num_hidden_layers=4, first_k_dense_replace=1).to_dict())
    kinds = []
    for rank in range(2):
        spec = decoder_spec(shape, attention_backend="auto", pp_rank=rank, pp_size=2)
        assert isinstance(spec, TransformerBlockSubmodules)
        kinds.append([getattr(s.submodules.mlp.submodules, "experts", None) is not None for s in spec.layer_specs])
    assert kinds == [[False, True], [True, True]]
    uniform = mc.shape_from_hf(glm4_moe_config(num_hidden_layers=4, first_k_dense_replace=0).to_dict())
    block = decoder_spec(uniform, attention_backend="auto", pp_rank=1, pp_size=2)
    assert len(block.layer_specs) == uniform.num_layers // 2 and len({id(s) for s in block.layer_specs}) == 1
