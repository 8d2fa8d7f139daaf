"""Qwen3-MoE under --train-backend megatron on the CPU: the config and flags, the expert weight layout, and
megatron-core's model (local spec, alltoall dispatcher) against transformers' on the same weights, at EP=1 and at EP=2
over gloo (two processes).

float32 both sides: the logits agree to float32 rounding only if every token reaches the same experts, which the
tests also check directly (router weights drawn wide, as transformers' default init nearly ties the experts' scores).
"""

from __future__ import annotations

import pytest
import torch

from runtime.train.backends import megatron_config as mc
from runtime.train.backends import megatron_moe as moe
from runtime.train.backends import megatron_weights as mw

QWEN3_MOE = dict(
    vocab_size=203,
    hidden_size=48,
    intermediate_size=80,
    moe_intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
# float32 against float32: two implementations of one model sum in different orders (a few ulps of values of order 1,
# compounded over two layers); a token sent to another expert would differ by O(0.1).
LOGIT_TOL = dict(rtol=1e-5, atol=1e-5)


def qwen3_moe_config(model_type: str = "qwen3_moe", **overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**QWEN3_MOE, **overrides})


def save_qwen3_moe(folder, *, seed: int = 0, **overrides) -> str:
    """A random tiny Qwen3-MoE in ``folder``: routers drawn wide (distinct expert scores), norms away from one."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(qwen3_moe_config(**overrides), dtype=torch.float32)
    widen(model, norm_std=0.1).save_pretrained(folder)
    return str(folder)


def widen(model, *, norm_std: float, bias_std: float | None = None, expert_bias_std: float | None = None):
    """``model``, in place: its routers drawn wide (distinct expert scores), its norms away from one (``norm_std``)
    and, where given, its other biases away from zero (``bias_std``) and its routers' expert biases large enough to
    change choices (``expert_bias_std``). Draws from torch's global generator, parameters then buffers in order."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
            elif "norm" in name:
                p.normal_(1.0, norm_std)
            elif bias_std is not None and name.endswith("bias"):
                p.normal_(0.0, bias_std)
        if expert_bias_std is not None:
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn(b.shape) * expert_bias_std)
    return model


# ------------------------------------------------------------------ config.json and flags


def test_shape_reads_qwen3_moe_in_both_spellings_of_num_experts():
    hf = qwen3_moe_config().to_dict()
    shape = mc.shape_from_hf(hf)
    assert shape.moe == moe.MoEShape(
        num_experts=8, router_topk=2, ffn_hidden_size=24, pre_softmax=False, layer_pattern=(1, 1)
    )
    assert shape.qk_layernorm and not shape.add_qkv_bias
    # The released checkpoints' config.json says num_experts; transformers 5 writes num_local_experts.
    released = {k: v for k, v in hf.items() if k != "num_local_experts"} | {"num_experts": 8}
    assert mc.shape_from_hf(released) == shape
    # norm_topk_prob false is Megatron's pre-softmax router (top k of the softmax over all experts, unnormalised).
    assert mc.shape_from_hf(hf | {"norm_topk_prob": False}).moe.pre_softmax


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"mlp_only_layers": [1]}, "mlp_only_layers [1]"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step 2"),
        ({"num_experts_per_tok": 1}, "num_experts_per_tok 1 with norm_topk_prob true"),
    ],
)
def test_refuses_what_megatron_would_compute_differently(fields, named):
    with pytest.raises(ValueError, match="cannot build this model") as err:
        mc.shape_from_hf(qwen3_moe_config().to_dict() | fields, source="ckpt/config.json")
    assert named in str(err.value) and "ckpt/config.json" in str(err.value)


@pytest.mark.parametrize(
    ("freq", "pattern"),
    [(1, (1, 1, 1, 1)), (2, (1, 0, 1, 0)), ("[0]*1+[1]*3", (0, 1, 1, 1)), ("[1, 1, 0, 1]", (1, 1, 0, 1))],
)
def test_layer_freq_reads_megatrons_forms(freq, pattern):
    assert moe.layer_pattern(freq, num_layers=4) == pattern


@pytest.mark.parametrize("freq", ["__import__('os')", "[1]*3", "[2]*4", "0", "[1]*4 - 1"])
def test_layer_freq_refuses_anything_else(freq):
    with pytest.raises(ValueError, match="--moe-layer-freq"):
        moe.layer_pattern(freq, num_layers=4)


def test_slimes_moe_shape_flags_agree_or_are_named():
    shape = mc.shape_from_hf(qwen3_moe_config().to_dict())
    agreeing = dict(
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=24,
        moe_router_score_function="softmax",
        moe_layer_freq="[1, 1]",
        moe_router_pre_softmax=False,
    )
    assert mc.shape_flag_problems(agreeing, shape) == []
    problems = mc.shape_flag_problems(
        agreeing | dict(num_experts=16, moe_layer_freq="[0]*1+[1]*1", moe_router_pre_softmax=True), shape
    )
    assert [p.split()[0] for p in problems] == ["--num-experts", "--moe-router-pre-softmax", "--moe-layer-freq"]
    assert "num_experts gives 8" in problems[0] and "norm_topk_prob" in problems[1]
    # On a dense model every MoE flag disagrees.
    dense = mc.shape_from_hf(qwen3_moe_config().to_dict() | {"model_type": "qwen3"})
    assert dense.moe is None
    assert mc.shape_flag_problems({"num_experts": 8}, dense)[0].startswith("--num-experts 8 disagrees")


def test_expert_parallelism_must_split_the_experts_of_a_moe_model():
    shape = mc.shape_from_hf(qwen3_moe_config().to_dict())
    assert mc.parallel_problems(shape, tp_size=1, pp_size=1, ep_size=4) == []
    (problem,) = mc.parallel_problems(shape, tp_size=1, pp_size=1, ep_size=3)
    assert "--expert-model-parallel-size 3 must divide num_experts 8" in problem
    dense = mc.shape_from_hf(qwen3_moe_config().to_dict() | {"model_type": "qwen3"})
    (problem,) = mc.parallel_problems(dense, tp_size=1, pp_size=1, ep_size=2)
    assert "dense qwen3 model" in problem


def _moe_job(tmp_path, model_type: str = "qwen3_moe") -> list[str]:
    """A real job's command line under --train-backend megatron whose config.json is the tiny Qwen3-MoE's (or, with
    ``model_type`` qwen3, the same model dense)."""
    folder = tmp_path / f"hf_{model_type}"
    qwen3_moe_config(model_type).save_pretrained(folder)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input": "1+1", "label": "2"}\n')
    return [
        "--train-backend",
        "megatron",
        "--hf-checkpoint",
        str(folder),
        "--prompt-data",
        str(prompts),
        "--rm-type",
        "math",
        "--rollout-max-response-len",
        "8",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--num-rollout",
        "1",
        "--actor-num-gpus-per-node",
        "2",
    ]


def _problems(argv) -> list[str]:
    from runtime.config import ConfigError, parse_args

    try:
        parse_args(argv)
    except ConfigError as err:
        return err.problems
    return []


def test_the_job_takes_slimes_moe_flags_and_names_each_disagreement(tmp_path):
    job = _moe_job(tmp_path)
    slime = [
        "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24", "--moe-layer-freq", "[1]*2",
        "--moe-router-score-function", "softmax", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
        "--moe-router-dtype", "fp32", "--moe-aux-loss-coeff", "0", "--moe-token-drop-policy", "probs",
        "--moe-permute-fusion", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
    ]  # fmt: skip
    assert _problems([*job, *slime]) == []
    problems = _problems([*job, "--num-experts", "16", "--moe-router-topk", "4", "--expert-model-parallel-size", "3"])
    assert sorted(p.split()[0] for p in problems) == [
        "--expert-model-parallel-size",
        "--moe-router-topk",
        "--num-experts",
    ], problems
    # Under the torch backend the training flags are refused (the shape flags are checked against config.json there
    # too); on a dense checkpoint expert parallelism has nothing to split.
    torch_job = [*job, "--train-backend", "torch", "--moe-grouped-gemm"]
    assert _problems(torch_job) == ["--moe-grouped-gemm: a Megatron flag, used by --train-backend megatron only"]
    (problem,) = _problems([*_moe_job(tmp_path, "qwen3"), "--expert-model-parallel-size", "2"])
    assert "--expert-model-parallel-size 2" in problem and "dense qwen3 model" in problem
    (problem,) = _problems([*job, "--moe-enable-deepep"])
    assert problem.startswith("--moe-enable-deepep: a Megatron flag rlcore's Megatron backend does not take: DeepEP")


def test_model_name_picks_slimes_qwen3moe_mapping():
    shape = mc.shape_from_hf(qwen3_moe_config().to_dict())
    assert mc.weight_mapping(mc.default_model_name("qwen3_moe"), shape) == "qwen3_moe"
    with pytest.raises(ValueError, match=r"experts and router"):
        mc.weight_mapping("qwen3", shape)  # slime's qwen2 mapping has no expert names
    with pytest.raises(ValueError, match="dense"):
        mc.weight_mapping("qwen3moe", mc.shape_from_hf(qwen3_moe_config().to_dict() | {"model_type": "qwen3"}))


# ------------------------------------------------------------------ weights


def _hf_state(seed: int = 0) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    from runtime.engines.checkpoint_layout import CheckpointLayout

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(qwen3_moe_config(), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    # The checkpoint's per-expert names (the wire layout), as save_pretrained writes them.
    return CheckpointLayout(model).state_dict(dict(model.state_dict()))


@pytest.mark.parametrize("ep_size", [1, 2, 4, 8])
def test_expert_parallel_shards_round_trip_exactly(ep_size):
    hf = _hf_state()
    shape = mc.shape_from_hf(qwen3_moe_config().to_dict())
    mw.check_hf_state(hf, shape)
    shards = [
        mw.to_megatron(hf, shape, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, ep_rank=r, ep_size=ep_size)
        for r in range(ep_size)
    ]
    expected = mw.megatron_shapes(shape, tp_size=1, pp_rank=0, pp_size=1, ep_size=ep_size)
    for shard in shards:
        assert {k: tuple(v.shape) for k, v in shard.items()} == expected
    # Rank r's local expert j is global expert r * E / ep + j, gate and up stacked.
    count = 8 // ep_size
    for r, shard in enumerate(shards):
        fc1 = shard[f"decoder.layers.1.mlp.experts.local_experts.{count - 1}.linear_fc1.weight"]
        e = r * count + count - 1
        assert torch.equal(fc1[:24], hf[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"])
        assert torch.equal(fc1[24:], hf[f"model.layers.1.mlp.experts.{e}.up_proj.weight"])
    back = {}
    for name in shards[0]:
        # An expert's tensor from every EP rank; everything else is whole on each rank.
        parts = [s[name] for s in shards] if moe.is_expert(name) else [shards[0][name]]
        back.update(mw.tensor_to_hf(name, parts, shape, pp_rank=0, pp_size=1))
    assert set(back) == set(hf)
    for name, value in hf.items():
        assert torch.equal(back[name], value), name


def test_to_hf_of_a_moe_model_round_trips():
    hf = _hf_state(seed=1)
    shape = mc.shape_from_hf(qwen3_moe_config().to_dict())
    shard = mw.to_megatron(hf, shape, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    back = mw.to_hf([[shard]], shape)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


def test_grouped_mm_equals_the_per_group_product():
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x = torch.randn(37, 32, generator=gen).to(dtype)
        w = torch.randn(4, 48, 32, generator=gen).to(dtype).transpose(1, 2)  # [G, K, M] column-major, as stacked
        counts = torch.tensor([9, 0, 20, 8])
        offs = torch.cumsum(counts, 0).to(torch.int32)
        got = moe.grouped_mm(x, w, offs=offs)
        want = torch.cat(
            [
                x[a:b].double() @ w[g].double()
                for g, (a, b) in enumerate(zip([0, 9, 9, 29], offs.tolist(), strict=True))
            ]
        )
        # float64 reference; the kernels accumulate in float32 (bf16 inputs are exact in it): K = 32 products of
        # O(1) values, relative error a few float32 ulps; bf16's output is rounded to 8 bits.
        tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float64: 1e-12}[dtype]
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * 8)
    assert moe.grouped_mm_takes(x.float(), w.float()) and not moe.grouped_mm_takes(x, w)  # float64: the loop


# ------------------------------------------------------------------ megatron-core's model

pytest.importorskip("megatron.core")


def _job(tmp_path, **overrides):
    from test_megatron_backend import job

    return job(tmp_path, train_backend="megatron", **overrides)


def _routes(module, sink: list) -> list:
    """Forward hooks recording each router's expert choice as a [tokens, E] bool map (batch-major)."""

    def megatron_router(mod, args, out):
        # megatron-core's router sees [s, b] tokens: its map is sequence-major.
        routing_map = out[1]
        s, b = args[0].shape[:2]
        sink.append(routing_map.view(s, b, -1).transpose(0, 1).reshape(s * b, -1))

    def hf_router(mod, args, out):
        indices = out[2]
        sink.append(torch.zeros(indices.shape[0], mod.weight.shape[0], dtype=torch.bool).scatter(1, indices, True))

    hooks = []
    for name, sub in module.named_modules():
        if name.endswith("mlp.router"):
            hooks.append(sub.register_forward_hook(megatron_router))
        elif name.endswith("mlp.gate"):
            hooks.append(sub.register_forward_hook(hf_router))
    return hooks


def routed_logits(mega, hf, mb):
    """Megatron's logits for ``mb`` (padded vocabulary), transformers' on the same tokens, and each one's routers'
    choices, layer by layer (:func:`_routes`)."""
    got_routes, want_routes = [], []
    hooks = _routes(mega.model, got_routes) + _routes(hf, want_routes)
    try:
        with mega._shims(), torch.no_grad():
            logits = mega._logits(mega.model, mb)
            tokens, _, _ = mega._inputs(mb)
            want = hf(input_ids=tokens).logits
    finally:
        for hook in hooks:
            hook.remove()
    return logits, want, got_routes, want_routes


@pytest.mark.parametrize("grouped_gemm", [False, True], ids=["sequential", "grouped"])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_logits_and_expert_choices_equal_transformers(norm_topk_prob, grouped_gemm, tmp_path, monkeypatch):
    from test_megatron_backend import make_batch, trainer
    from transformers import AutoModelForCausalLM

    from runtime.train.roles import ACTOR

    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or grouped_mm(*a, **k))
    path = save_qwen3_moe(tmp_path / "m", norm_topk_prob=norm_topk_prob)
    mega = trainer("megatron", path, _job(tmp_path, moe_grouped_gemm=grouped_gemm), roles=(ACTOR,))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    try:
        mb = make_batch(203)[:5]
        got_routes, want_routes = [], []
        hooks = _routes(mega.model, got_routes) + _routes(hf, want_routes)
        with mega._shims(), torch.no_grad():
            logits = mega._logits(mega.model, mb)
            megatron_calls = len(calls)  # transformers' experts may call it too
            tokens, _, _ = mega._inputs(mb)
            want = hf(input_ids=tokens).logits
        for hook in hooks:
            hook.remove()
        # --moe-grouped-gemm: both expert layers of both MoE layers through torch._grouped_mm; else none.
        assert megatron_calls == (4 if grouped_gemm else 0)
        assert len(got_routes) == len(want_routes) == 2
        for got, expected in zip(got_routes, want_routes, strict=True):
            assert torch.equal(got, expected)
        assert logits.shape[-1] == 256  # the vocabulary padded to Megatron's multiple of 128: not tokens
        torch.testing.assert_close(logits[..., :203], want, **LOGIT_TOL)
    finally:
        mega.shutdown()


@pytest.mark.parametrize("grouped_gemm", [False, True], ids=["sequential", "grouped"])
def test_rl_step_matches_the_torch_backend(grouped_gemm, tmp_path):
    """The log-probs, loss, gradient norm and the weights after one RL step of the Megatron backend equal the torch
    backend's (transformers' Qwen3-MoE with its grouped experts) on the same weights and batch; with megatron-core's
    per-expert loop and with ``--moe-grouped-gemm``'s stacked experts (one parameter for each layer's local
    experts' first and one for their second linears)."""
    from test_megatron_backend import LOGP_TOL, job, make_batch, train_once, trainer

    from rlcore import keys

    path = save_qwen3_moe(tmp_path / "m")
    cfg = job(tmp_path)
    td = make_batch(203)
    torch_backend = trainer("torch", path, cfg)
    mega = trainer("megatron", path, job(tmp_path, moe_grouped_gemm=grouped_gemm))
    try:
        # Every expert weight, and no other, carries megatron-core's mark for the expert-data-parallel gradient
        # reduction, also at EP = 1 (its DDP reads it on GPUs: tests/test_megatron_replay_cuda.py[tp2-sp] failed
        # without it).
        from runtime.train.backends import megatron_moe as mmoe

        marked = {n for n, p in mega.model.named_parameters() if not getattr(p, "allreduce", True)}
        assert marked == {n for n, _ in mega.model.named_parameters() if mmoe.is_expert(n)} != set()
        # Two layers of 8 experts: one tensor per expert and linear, or one per layer and linear.
        assert len(marked) == (2 * 2 if grouped_gemm else 2 * 8 * 2)
        ref_lp, got_lp = torch_backend.compute_log_probs(td), mega.compute_log_probs(td)
        mask = td[keys.MASK]
        for key in (keys.OLD_LOG_PROBS, keys.REF_LOG_PROBS):
            torch.testing.assert_close(got_lp[key][mask], ref_lp[key][mask], **LOGP_TOL)
        want, got = train_once(torch_backend, cfg, td), train_once(mega, cfg, td)
        for name in ("loss", "pg_loss", "entropy_loss", "kl_loss"):
            assert got[name] == pytest.approx(want[name], rel=1e-4, abs=1e-6), name
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        after_torch, after_mega = torch_backend.get_weights(), mega.get_weights()
        assert set(after_mega) == set(after_torch)
        for name, value in after_mega.items():
            # Adam's first step is about lr x sign(gradient): where a gradient is near zero (float32 rounding) the two
            # may move an element differently, by a fraction of one step (lr 1e-3).
            torch.testing.assert_close(value, after_torch[name], rtol=0, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
    finally:
        mega.shutdown()
        torch_backend.shutdown()


@pytest.mark.parametrize(
    "saved_grouped,loaded_grouped",
    [(False, False), (True, False), (False, True)],
    ids=["sequential", "grouped-to-sequential", "sequential-to-grouped"],
)
def test_a_torch_dist_checkpoint_of_experts_converts_and_loads(saved_grouped, loaded_grouped, tmp_path):
    """The actor exported as an HF folder (``save_pretrained``'s per-expert names) and saved as ``torch_dist``
    (megatron-core stores each layer's experts as one tensor, global expert index first): both equal the trainer's
    exported weights, and a trainer started from the ``torch_dist`` folder holds the same weights; a checkpoint of
    ``--moe-grouped-gemm``'s stacked experts and one of megatron-core's per-expert ``SequentialMLP`` load into each
    other."""
    from test_megatron_backend import job, trainer

    from runtime.train.backends import megatron_checkpoint as mck
    from runtime.train.roles import ACTOR

    path = save_qwen3_moe(tmp_path / "m")
    cfg = job(tmp_path, moe_grouped_gemm=saved_grouped)
    mega = trainer("megatron", path, cfg, roles=(ACTOR,))
    try:
        weights = mega.get_weights()
        mega.save_model(str(tmp_path / "ckpt"))
        mega.save_hf(str(tmp_path / "hf_out"))  # the job's final export: transformers' model, experts fused
    finally:
        mega.shutdown()
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "hf_out" / "model.safetensors"))
    assert set(exported) == set(weights) and all(torch.equal(exported[k], weights[k]) for k in weights)
    shape = mc.shape_from_hf(qwen3_moe_config().to_dict())
    converted = mck.hf_state_from_checkpoint(tmp_path / "ckpt", shape)
    assert set(converted) == set(weights) and all(torch.equal(converted[k], weights[k]) for k in weights)
    cfg = job(tmp_path, moe_grouped_gemm=loaded_grouped)
    loaded = trainer("megatron", path, cfg, roles=(ACTOR,), role_paths={ACTOR.name: str(tmp_path / "ckpt")})
    try:
        again = loaded.get_weights()
        assert all(torch.equal(again[k], weights[k]) for k in weights)
    finally:
        loaded.shutdown()


def test_grouped_experts_refuse_the_one_key_per_expert_layout(tmp_path):
    """megatron-core's ``singleton_local_shards`` checkpoint layout (each expert under its own key) is not what the
    stacked experts save: asked for, their ``sharded_state_dict`` names it in one line rather than saving the default
    layout under a request for another."""
    from test_megatron_backend import job, trainer

    from runtime.train.roles import ACTOR

    mega = trainer("megatron", save_qwen3_moe(tmp_path / "m"), job(tmp_path, moe_grouped_gemm=True), roles=(ACTOR,))
    try:
        experts = [m for m in mega.model.modules() if type(m).__name__ == "GroupedGemmExperts"]
        assert experts and experts[0].sharded_state_dict(prefix="e.")  # the default layout saves
        with pytest.raises(ValueError, match="singleton_local_shards"):
            experts[0].sharded_state_dict(prefix="e.", metadata={"singleton_local_shards": True})
    finally:
        mega.shutdown()


def test_grouped_experts_resume_exactly(tmp_path):
    """``--moe-grouped-gemm``'s stacked experts with their AdamW moments through a ``torch_dist`` save and load: the
    step after the resume is the step of the trainer that saved and went on, bitwise (the same kernels on the same
    numbers); the moments live on the stacked parameters."""
    from test_megatron_backend import job, make_batch, train_once, trainer

    from runtime.train.roles import ACTOR

    path = save_qwen3_moe(tmp_path / "m")
    cfg = job(tmp_path, moe_grouped_gemm=True, use_kl_loss=False)
    td = make_batch(203)
    folder = str(tmp_path / "ckpt")
    runs = []
    for resume in (False, True):
        mega = trainer("megatron", path, cfg, roles=(ACTOR,))
        try:
            if resume:
                mega.load(folder)
            else:
                train_once(mega, cfg, td)
                mega.save(folder)
            metrics = train_once(mega, cfg, td)
            stacked = {n: p for n, p in mega.model.named_parameters() if n.endswith("mlp.experts.weight1")}
            moments = {n: mega.optimizer.state[p]["exp_avg_sq"].clone() for n, p in stacked.items()}
            runs.append((metrics, mega.get_weights(), moments))
        finally:
            mega.shutdown()
    (want, want_weights, want_moments), (got, got_weights, got_moments) = runs
    assert len(want_moments) == 2 and all(torch.equal(got_moments[n], m) for n, m in want_moments.items())
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    assert all(torch.equal(got_weights[n], w) for n, w in want_weights.items())


# ------------------------------------------------------------------ expert parallelism over gloo

STEPS = 3


def _train_steps(backend, cfg, td, rows: slice) -> list[dict[str, float]]:
    """``STEPS`` RL steps over ``td[rows]`` (this rank's shard): old log-probs recomputed each step and perturbed by
    a fixed function of the global row and position (so that the ratio is not one), GRPO advantages (the shards hold
    whole groups)."""
    from rlcore import keys
    from rlcore.advantages import compute
    from runtime.train.algo import advantage_config

    mask = td[keys.MASK]
    perturb = 0.05 * torch.sin(torch.arange(mask.numel(), dtype=torch.float32)).view_as(mask)
    metrics = []
    for _ in range(STEPS):
        part = td[rows].clone()
        part.update(backend.compute_log_probs(part))
        part.set(keys.OLD_LOG_PROBS, part[keys.OLD_LOG_PROBS] + perturb[rows])
        part = compute(part, advantage_config(cfg))
        metrics.append(backend.train(part, per_step_rows=part.batch_size[0]))
    return metrics


def _run(backend, cfg, td, rows: slice) -> dict:
    """The logits of the shard's first micro-batch, its log-probs, ``STEPS`` steps' metrics and the exported
    weights."""
    from rlcore import keys

    with backend._shims(), torch.no_grad():
        logits = backend._logits(backend.model, td[rows])[..., :203].clone()
    log_probs = backend.compute_log_probs(td[rows])[keys.OLD_LOG_PROBS]
    metrics = _train_steps(backend, cfg, td, rows)
    return {"logits": logits, "log_probs": log_probs, "metrics": metrics, "weights": backend.get_weights()}


def _ep_worker(rank, port, path, tmp, out, grouped):
    from test_megatron_backend import make_batch, trainer

    cfg = _job(tmp, expert_model_parallel_size=2, actor_num_gpus_per_node=2, moe_grouped_gemm=grouped)
    mega = trainer("megatron", path, cfg, rank=rank, world_size=2, master_port=port)
    try:
        assert mega.dp_info() == (rank, 2)  # EP splits the experts of the two data-parallel replicas
        result = _run(mega, cfg, make_batch(203), slice(4 * rank, 4 * rank + 4))
        result["experts"] = sorted(n for n, _ in mega.model.named_parameters() if moe.is_expert(n))
        torch.save(result, f"{out}.{rank}")
    finally:
        mega.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
def test_expert_parallel_two_ranks_equal_one(grouped, tmp_path, gloo_ranks):
    """EP=2 over gloo (two processes, each a data-parallel rank with half the experts and half the rows) against EP=1
    (one process, all rows): the same logits and log-probs, the same losses and gradient norms over three steps,
    the same exported weights; with megatron-core's per-expert loop and with the stacked grouped experts."""
    from test_megatron_backend import _free_port, make_batch, trainer

    path = save_qwen3_moe(tmp_path / "m")
    out = str(tmp_path / "ep2.pt")
    gloo_ranks.run(_ep_worker, _free_port(), path, tmp_path, out, grouped)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    # Each rank holds 4 of the 8 experts of each of the 2 layers (2 tensors each, or 2 stacks of the 4).
    assert len(ranks[0]["experts"]) == (2 * 2 if grouped else 2 * 4 * 2)
    cfg = _job(tmp_path)
    one = trainer("megatron", path, cfg)
    try:
        td = make_batch(203)
        want = _run(one, cfg, td, slice(0, 8))
        for r, got in enumerate(ranks):
            # A shard is as wide as its own longest row; causal attention: wider padding changes no real column.
            width = got["logits"].shape[1]
            torch.testing.assert_close(got["logits"], want["logits"][4 * r : 4 * r + 4, :width], **LOGIT_TOL)
        from rlcore import keys

        mask = td[keys.MASK]
        got_lp = torch.cat([r["log_probs"] for r in ranks])
        torch.testing.assert_close(got_lp[mask], want["log_probs"][mask], **LOGIT_TOL)
        for step in range(STEPS):
            for name in ("loss", "pg_loss", "kl_loss", "grad_norm"):
                values = {r["metrics"][step][name] for r in ranks}
                assert len(values) == 1, (step, name, values)  # reduced over the data-parallel ranks
                assert values.pop() == pytest.approx(want["metrics"][step][name], rel=1e-4, abs=1e-6), (step, name)
        assert ranks[1]["weights"] is None
        exported = ranks[0]["weights"]
        assert set(exported) == set(want["weights"])
        for name, value in want["weights"].items():
            # Adam moves an element by about lr (1e-3) x sign(gradient) a step: where a gradient is near zero,
            # float32 rounding may move it differently, by a fraction of a step in each of the three.
            torch.testing.assert_close(exported[name], value, rtol=0, atol=6e-5, msg=lambda m, n=name: f"{n}: {m}")
    finally:
        one.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_grpo_steps_at_ep2_through_rlcore_run_on_the_cpu(monkeypatch, tmp_path):
    """The CPU twin of tests/test_megatron_moe_cuda.py's job: the built-in task on the tiny Qwen3-MoE preset, two
    Megatron trainer processes at EP=2 (gloo) with an engine colocated on each, three steps through rlcore-run's
    config and loop. The engines sample with the weights the trainers hold (experts gathered from both EP ranks), in
    float32: the recomputed log-probs equal the rollout's."""
    import ray

    from runtime import demo
    from runtime.config import parse_args
    from runtime.demo import task
    from runtime.demo.tiny_model import make_preset_model
    from runtime.logger import METRICS_FILE, read_metrics
    from runtime.loop import run

    def base_model(output_dir, *, seed):
        return str(make_preset_model("tiny-qwen3-moe", f"{output_dir}/base_model", alphabet=task.ALPHABET, seed=seed))

    monkeypatch.setattr(demo, "base_model", base_model)
    argv = [
        "--train-backend", "megatron", "--expert-model-parallel-size", "2", "--actor-num-gpus-per-node", "2",
        "--colocate", "--num-rollout", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--global-batch-size", "16", "--output-dir", str(tmp_path / "job"),
    ]  # fmt: skip
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        result = run(parse_args(argv), progress=False)
    finally:
        ray.shutdown()
    rows = read_metrics(result.output_dir / METRICS_FILE)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert row["train/num_steps"] == 1 and 0.0 < row["train/grad_norm"] < 1e3
        # float32 engine and trainer on the same weights: summation order only (a mis-mapped expert gives O(1)).
        assert row["train/rollout_log_prob_abs_diff"] < 1e-4, row["train/rollout_log_prob_abs_diff"]
