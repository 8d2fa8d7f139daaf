"""slime's flags of its Megatron backend under --train-backend megatron (CPU, gloo): --distributed-backend,
--distributed-timeout-minutes, --padded-vocab-size, --model-name, --custom-model-provider-path,
--recompute-loss-function, --opd-teacher-ckpt-step and --megatron-config-path; the torch backend refuses them, and
--release-train, --allgather-cp, --freeze-indexer and --async-save are refused with their own reasons."""

from __future__ import annotations

import datetime
import json

import pytest
import torch

pytest.importorskip("megatron.core")

from test_megatron_backend import job, make_batch, save_model, train_once, trainer  # noqa: E402
from test_megatron_checkpoint import _fake_checkpoint  # noqa: E402
from test_megatron_mapping import hf_config  # noqa: E402

from rlcore import keys  # noqa: E402
from runtime import slime_flags  # noqa: E402
from runtime.config import ConfigError, parse_args  # noqa: E402
from runtime.train.backends import megatron_checkpoint as mck  # noqa: E402
from runtime.train.backends import megatron_config as mc  # noqa: E402
from runtime.train.hooks import train_hooks  # noqa: E402
from runtime.train.roles import ACTOR  # noqa: E402

MEGA = ("--train-backend", "megatron")
VOCAB = 203  # the tiny models' (test_megatron_mapping.hf_config): padded to 256 rows at TP=1


def _plain(path, tmp_path, td, key=keys.OLD_LOG_PROBS, *, roles=(ACTOR,), **settings):
    """``key`` of ``td`` from a Megatron trainer of ``path`` without the flags under test (the reference a test
    compares with), shut down after."""
    plain = trainer("megatron", path, job(tmp_path, **{"train_backend": "megatron", **settings}), roles=roles)
    try:
        return plain.compute_log_probs(td)[key]
    finally:
        plain.shutdown()


def _real_job(tmp_path, model_type: str = "qwen3", **overrides) -> list[str]:
    """A command line of a real job (HF checkpoint, prompt file) whose config.json is ``model_type``'s."""
    folder = tmp_path / f"hf_{model_type}"
    if not folder.exists():
        hf_config(model_type, **overrides).save_pretrained(folder)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input": "1+1", "label": "2"}) + "\n")
    return [
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
        "1",
        "--output-dir",
        str(tmp_path / "out"),
    ]


# -- the table and the torch backend ------------------------------------------------------------------------------

BUILT = {
    "--distributed-backend": "gloo",
    "--distributed-timeout-minutes": "3",
    "--padded-vocab-size": "384",
    "--model-name": "qwen3",
    "--recompute-loss-function": None,
}


@pytest.mark.parametrize("name", sorted(BUILT))
def test_the_torch_backend_refuses_the_megatron_backends_flags_naming_it(name, tmp_path):
    value = BUILT[name]
    argv = [name] if value is None else [name, value]
    refusal = f"{name}: a flag of slime's Megatron backend, used by --train-backend megatron"
    with pytest.raises(ConfigError, match=refusal):
        parse_args([*argv, "--train-backend", "torch"])  # named: alone, the flag selects megatron (slime_compat)
    assert slime_flags.BY_NAME[name].status == slime_flags.DIFFERS
    parse_args([*MEGA, *argv])  # the same command line under the Megatron backend is a valid job


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("--release-train", "long-lived actors"),
        ("--allgather-cp", "DeepSeek sparse attention"),
        ("--freeze-indexer", "indexer of DeepSeek sparse attention"),
        ("--async-save", "asynchronous save"),
    ],
)
def test_flags_rlcore_does_not_build_are_refused_with_their_own_reason(name, reason):
    for argv in ([name], [*MEGA, name]):
        with pytest.raises(ConfigError) as err:
            parse_args(argv)
        assert reason in str(err.value) and slime_flags.MEGATRON not in str(err.value)
    parse_args([*MEGA])  # at slime's default (absent) they are no problem


def test_distributed_timeout_must_be_positive():
    with pytest.raises(ConfigError, match="--distributed-timeout-minutes must be > 0, got 0"):
        parse_args([*MEGA, "--distributed-timeout-minutes", "0"])
    with pytest.raises(SystemExit):
        parse_args([*MEGA, "--distributed-backend", "mpi"])  # Megatron's choices: nccl, gloo


# -- --model-name and config.json --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "mapping"),
    [
        ("qwen3", "qwen2"),
        ("Qwen3Config", "qwen2"),
        ("qwen2.5", "qwen2"),
        ("llama", "llama"),
        ("LlamaConfig", "llama"),
        ("qwen3moe", "qwen3_moe"),
        ("qwen3-moe", "qwen3_moe"),
        ("Qwen3MoeConfig", "qwen3_moe"),
        ("glm4", "glm4"),
        ("Glm4Config", "glm4"),
        ("glm4moe", "glm4_moe"),
        ("glm4-moe", "glm4_moe"),
        ("deepseekv3", "deepseek_v3"),
        ("DeepseekV3Config", "deepseek_v3"),
    ],
)
def test_model_names_follow_slimes_rules(name, mapping):
    assert mc.mapping_of_name(name) == mapping


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("qwen2moe", "mixture-of-experts"),
        ("glm4moelite", "mixture-of-experts"),
        ("minimax-m2", "mixture-of-experts"),
        ("qwen3vl", "vision-language"),
        ("mistral", "no weight mapping of slime's"),
    ],
)
def test_model_names_rlcore_does_not_build_are_refused(name, reason, tmp_path):
    with pytest.raises(ValueError, match=f"--model-name {name}: .*{reason}"):
        mc.mapping_of_name(name)
    with pytest.raises(ConfigError, match=f"--model-name {name}: .*{reason}"):
        parse_args([*MEGA, *_real_job(tmp_path), "--model-name", name])


def test_model_name_must_map_every_tensor_of_the_checkpoint(tmp_path):
    # Llama's mapping (slime's convert_llama_to_hf) has no name for Qwen3's QK-norms nor Qwen2's q/k/v biases.
    with pytest.raises(ConfigError, match=r"--model-name llama: .*no name for the QK-norms .*use --model-name qwen3"):
        parse_args([*MEGA, *_real_job(tmp_path, "qwen3"), "--model-name", "llama"])
    with pytest.raises(ConfigError, match=r"--model-name llama: .*no name for the q/k/v biases"):
        parse_args([*MEGA, *_real_job(tmp_path, "qwen2"), "--model-name", "llama"])
    # Qwen2's mapping is a superset of Llama's.
    cfg = parse_args([*MEGA, *_real_job(tmp_path, "llama"), "--model-name", "qwen2"])
    assert cfg.train.model_name == "qwen2"
    shape = mc.shape_from_hf(hf_config("qwen3").to_dict())
    assert mc.weight_mapping(mc.default_model_name("qwen3"), shape) == "qwen2"


def test_a_mistral_style_sliding_window_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"sliding_window 4096 \(attention over a sliding window, Mistral-style\)"):
        mc.shape_from_hf({**hf_config("llama").to_dict(), "sliding_window": 4096})
    # Qwen2's config.json names a window and switches it off.
    mc.shape_from_hf(hf_config("qwen2", sliding_window=4096, use_sliding_window=False).to_dict())
    with pytest.raises(ValueError, match="use_sliding_window true"):
        mc.shape_from_hf(hf_config("qwen2", sliding_window=4096, use_sliding_window=True).to_dict())
    with pytest.raises(ConfigError, match="sliding_window 512"):
        parse_args([*MEGA, *_real_job(tmp_path, "llama", sliding_window=512)])


# -- --padded-vocab-size ------------------------------------------------------------------------------------------


def test_a_padded_vocab_smaller_than_the_vocab_or_not_split_over_tp_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=rf"--padded-vocab-size 200 is smaller than the vocabulary \({VOCAB}"):
        parse_args([*MEGA, *_real_job(tmp_path), "--padded-vocab-size", "200"])
    with pytest.raises(ConfigError, match="--padded-vocab-size 301 does not split over --tensor-model-parallel-size"):
        parse_args(
            [*MEGA, *_real_job(tmp_path), "--padded-vocab-size", "301", "--tensor-model-parallel-size", "2"]
            + ["--actor-num-gpus-per-node", "2"]
        )
    assert parse_args([*MEGA, *_real_job(tmp_path), "--padded-vocab-size", "203"]).train.padded_vocab_size == VOCAB


def test_padded_vocab_rows_start_at_zero_and_exports_cut_them_off(tmp_path):
    from safetensors.torch import load_file

    from tools.convert_megatron_to_hf import convert

    path = save_model("llama", tmp_path / "m")  # untied: the embedding and the output layer are padded
    td = make_batch(VOCAB)
    want = _plain(path, tmp_path, td)
    mega = trainer("megatron", path, job(tmp_path, train_backend="megatron", padded_vocab_size=320), roles=(ACTOR,))
    try:
        module = mega._module(mega.model)
        for weight in (module.embedding.word_embeddings.weight, module.output_layer.weight):
            assert weight.shape == (320, 48)  # Megatron's own padding would be 256 rows
            assert torch.equal(weight[VOCAB:], torch.zeros(320 - VOCAB, 48))
        got = mega.compute_log_probs(td)[keys.OLD_LOG_PROBS]
        mask = td[keys.MASK]
        torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=1e-6)
        saved = load_file(f"{path}/model.safetensors")
        weights = mega.get_weights()
        buckets = {k: v for b in mega.weight_buckets(dtype=torch.float32, bucket_bytes=1 << 20) for k, v in b.items()}
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(weights[name], saved[name]) and torch.equal(buckets[name], saved[name]), name
        mega.save_model(str(tmp_path / "ckpt"))
        assert mck.read_common(tmp_path / "ckpt")["args"].padded_vocab_size == 320
        assert mck.read_model_tensors(tmp_path / "ckpt")["embedding.word_embeddings.weight"].shape == (320, 48)
    finally:
        mega.shutdown()
    out = convert(str(tmp_path / "ckpt"), str(tmp_path / "hf_out"), model_name="llama")
    exported = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert torch.equal(exported["model.embed_tokens.weight"], saved["model.embed_tokens.weight"])
    with pytest.raises(
        ValueError, match="--model-name qwen3moe: slime's qwen3_moe mapping is for MoE models; this llama"
    ):
        convert(str(tmp_path / "ckpt"), str(tmp_path / "hf_moe"), model_name="qwen3moe")


def _padded_tp_worker(rank, world, port, path, tmp, out):
    cfg = job(
        tmp,
        train_backend="megatron",
        tensor_model_parallel_size=2,
        actor_num_gpus_per_node=2,
        padded_vocab_size=320,
        distributed_timeout_minutes=4,
    )
    mega = trainer("megatron", path, cfg, roles=(ACTOR,), rank=rank, world_size=world, master_port=port)
    try:
        shard = mega._module(mega.model).embedding.word_embeddings.weight.detach().clone()
        result = {
            "shard": shard,
            "log_probs": mega.compute_log_probs(make_batch(VOCAB))[keys.OLD_LOG_PROBS],
            "timeout": _timeout(mega.ps.get_tensor_model_parallel_group()),
            "weights": mega.get_weights(),
        }
        torch.save(result, f"{out}.{rank}")
    finally:
        mega.shutdown()


def test_a_padded_vocab_splits_over_two_tensor_parallel_ranks(tmp_path, gloo_ranks):
    from safetensors.torch import load_file
    from test_megatron_backend import LOGP_TOL, _free_port

    path = save_model("llama", tmp_path / "m")
    out = str(tmp_path / "tp2.pt")
    gloo_ranks.run(_padded_tp_worker, 2, _free_port(), path, tmp_path, out)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    saved = load_file(f"{path}/model.safetensors")
    # 320 rows, 160 per rank: rank 1 holds tokens 160..202, then zero rows up to 319.
    assert ranks[0]["shard"].shape == ranks[1]["shard"].shape == (160, 48)
    assert torch.equal(ranks[0]["shard"], saved["model.embed_tokens.weight"][:160])
    assert torch.equal(ranks[1]["shard"][: VOCAB - 160], saved["model.embed_tokens.weight"][160:])
    assert torch.equal(ranks[1]["shard"][VOCAB - 160 :], torch.zeros(320 - VOCAB, 48))
    assert all(r["timeout"] == datetime.timedelta(minutes=4) for r in ranks)
    assert ranks[1]["weights"] is None and set(ranks[0]["weights"]) == set(saved)
    for name, value in saved.items():
        assert torch.equal(ranks[0]["weights"][name], value), name
    td = make_batch(VOCAB)
    want = _plain(path, tmp_path, td)
    mask = td[keys.MASK]
    torch.testing.assert_close(ranks[0]["log_probs"][mask], want[mask], **LOGP_TOL)


def test_save_hf_of_a_padded_vocab_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from runtime.demo import task
    from runtime.demo.tiny_model import make_tiny_model

    path = str(make_tiny_model(tmp_path / "tiny", alphabet=task.ALPHABET))
    original = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    mega = trainer("megatron", path, job(tmp_path, train_backend="megatron", padded_vocab_size=512), roles=(ACTOR,))
    try:
        assert mega._module(mega.model).embedding.word_embeddings.weight.shape[0] == 512
        mega.save_hf(str(tmp_path / "export"))
    finally:
        mega.shutdown()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    assert exported.config.vocab_size == original.config.vocab_size < 512
    for name, value in original.state_dict().items():
        assert torch.equal(exported.state_dict()[name], value), name


# -- --distributed-backend / --distributed-timeout-minutes --------------------------------------------------------


def _timeout(group) -> datetime.timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


@pytest.mark.parametrize(
    ("flag_value", "device", "backend"),
    [("nccl", "cuda", "nccl"), ("gloo", "cuda", "gloo"), ("nccl", "cpu", "gloo"), ("gloo", "cpu", "gloo")],
)
def test_the_distributed_backend_is_the_flags_on_gpus_and_gloo_on_the_cpu(flag_value, device, backend):
    from runtime.train.backends.megatron_backend import process_group_backend

    assert process_group_backend(flag_value, device=torch.device(device)) == backend
    with pytest.raises(ValueError, match="--distributed-backend must be nccl or gloo"):
        process_group_backend("mpi", device=torch.device(device))


def test_the_timeout_reaches_the_process_group_and_megatrons_groups(tmp_path):
    path = save_model("qwen3", tmp_path / "m")
    cfg = job(tmp_path, train_backend="megatron", distributed_timeout_minutes=3, distributed_backend="nccl")
    mega = trainer("megatron", path, cfg, roles=(ACTOR,))
    try:
        import torch.distributed as dist

        assert dist.get_backend() == "gloo"  # the CPU's only backend, whatever --distributed-backend says
        want = datetime.timedelta(minutes=3)
        assert _timeout(dist.distributed_c10d._get_default_group()) == want
        for group in (mega.ps.get_tensor_model_parallel_group(), mega.ps.get_data_parallel_group()):
            assert _timeout(group) == want
    finally:
        mega.shutdown()


# -- --custom-model-provider-path ---------------------------------------------------------------------------------

PROVIDERS = """
from megatron.core.models.gpt import GPTModel

from runtime.train.backends.megatron_backend import provider_context


def model_provider(pre_process, post_process, vp_stage=None):
    ctx = provider_context()
    return GPTModel(
        config=ctx.config,
        transformer_layer_spec=ctx.layer_spec,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        **ctx.gpt_model_kwargs,
    )


def without_vp_stage(pre_process, post_process):
    return model_provider(pre_process, post_process)


def wider_vocab(pre_process, post_process):
    ctx = provider_context()
    kwargs = {**ctx.gpt_model_kwargs, "vocab_size": ctx.gpt_model_kwargs["vocab_size"] + 128}
    return GPTModel(config=ctx.config, transformer_layer_spec=ctx.layer_spec, pre_process=pre_process,
                    post_process=post_process, **kwargs)


def not_a_model(pre_process, post_process):
    return "model"


def counted(pre_process, post_process):
    with open(__file__ + ".calls", "a") as calls:
        calls.write("call ")
    return model_provider(pre_process, post_process)
"""


def _provider_trainer(tmp_path, path, fn):
    hooks = tmp_path / "providers.py"
    hooks.write_text(PROVIDERS)
    cfg = job(tmp_path, train_backend="megatron", custom_model_provider_path=f"{hooks}:{fn}")
    return trainer("megatron", path, cfg, roles=(ACTOR,), hooks=train_hooks(cfg))


def test_a_custom_model_provider_builds_the_model_with_rlcores_config_and_is_checked(tmp_path):
    from runtime.train.backends.megatron_backend import provider_context

    path = save_model("qwen3", tmp_path / "m")
    td = make_batch(VOCAB)
    want = _plain(path, tmp_path, td)
    for fn in ("model_provider", "without_vp_stage"):
        mega = _provider_trainer(tmp_path, path, fn)
        try:
            assert torch.equal(mega.compute_log_probs(td)[keys.OLD_LOG_PROBS], want), fn
        finally:
            mega.shutdown()
    with pytest.raises(ValueError, match=r"--custom-model-provider-path .*wider_vocab.*embedding.word_embeddings"):
        _provider_trainer(tmp_path, path, "wider_vocab")
    with pytest.raises(ValueError, match="--custom-model-provider-path returned str, not a megatron-core GPTModel"):
        _provider_trainer(tmp_path, path, "not_a_model")
    with pytest.raises(RuntimeError, match="only inside a --custom-model-provider-path call"):
        provider_context()


# -- --recompute-loss-function ------------------------------------------------------------------------------------


def _train_and_count_saved(tmp_path, path, td, *, recompute: bool):
    cfg = job(tmp_path, train_backend="megatron", recompute_loss_function=recompute, use_kl_loss=False)
    mega = trainer("megatron", path, cfg, roles=(ACTOR,))
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            metrics = train_once(mega, cfg, td)
        grads = {name: p.grad.clone() for name, p in mega._module(mega.model).named_parameters()}
        return metrics, grads, mega.get_weights(), sum(saved)
    finally:
        mega.shutdown()


def test_recomputing_the_loss_gives_bitwise_the_same_step_and_keeps_less_for_backward(tmp_path):
    path = save_model("qwen2", tmp_path / "m")
    td = make_batch(VOCAB)
    off, grads_off, weights_off, saved_off = _train_and_count_saved(tmp_path, path, td, recompute=False)
    on, grads_on, weights_on, saved_on = _train_and_count_saved(tmp_path, path, td, recompute=True)
    assert on == off  # loss, its terms and the gradient norm, bit for bit
    assert grads_on.keys() == grads_off.keys()
    for name, grad in grads_off.items():
        assert grad.abs().sum() > 0 and torch.equal(grads_on[name], grad), name
    for name, value in weights_off.items():
        assert torch.equal(weights_on[name], value), name
    # The loss's intermediates (a float32 softmax over the vocabulary per token) are not kept for backward.
    assert saved_on < saved_off


def test_recomputing_the_loss_over_padded_vocabulary_rows_in_bf16_gives_the_same_step(tmp_path):
    """bf16 with padded vocabulary rows, whose logits the log-prob pass fills with -inf in place inside the
    recomputed function: the same step bit for bit with and without --recompute-loss-function (a fill autograd sees
    failed the recompute with a version error; no saved-tensor hooks here, which would skip that check)."""
    path = save_model("qwen3", tmp_path / "m")
    td = make_batch(VOCAB)
    runs = {}
    for recompute in (False, True):
        cfg = job(
            tmp_path,
            train_backend="megatron",
            bf16="true",
            padded_vocab_size=384,
            recompute_loss_function=recompute,
            use_kl_loss=False,
        )
        mega = trainer("megatron", path, cfg, roles=(ACTOR,))
        try:
            runs[recompute] = train_once(mega, cfg, td), mega.get_weights()
        finally:
            mega.shutdown()
    (off, weights_off), (on, weights_on) = runs[False], runs[True]
    assert on == off
    for name, value in weights_off.items():
        assert torch.equal(weights_on[name], value), name


# -- --opd-teacher-ckpt-step --------------------------------------------------------------------------------------


def test_opd_teacher_ckpt_step_picks_a_step_of_the_teacher_save_root(tmp_path):
    from runtime.train.algo import role_paths
    from runtime.train.roles import TEACHER

    root = tmp_path / "teacher"
    step3 = _fake_checkpoint(root / "iter_0000003")
    latest = _fake_checkpoint(root / "iter_0000009")
    (root / mck.TRACKER).write_text("9")
    opd = ("--use-opd", "--opd-type", "megatron", "--opd-teacher-load", str(root))
    assert role_paths(parse_args([*MEGA, *opd, "--opd-teacher-ckpt-step", "3"]))[TEACHER.name] == str(step3)
    assert mck.find_checkpoint(role_paths(parse_args([*MEGA, *opd]))[TEACHER.name]) == latest
    with pytest.raises(ConfigError, match=r"--opd-teacher-load .*iter_0000004 is no torch_dist .*ckpt-step 4\)"):
        parse_args([*MEGA, *opd, "--opd-teacher-ckpt-step", "4"])
    with pytest.raises(ConfigError, match="--opd-teacher-ckpt-step picks a step .* needs --train-backend megatron"):
        parse_args([*opd, "--opd-teacher-ckpt-step", "3"])
    with pytest.raises(ConfigError, match="Megatron torch_dist checkpoints need --train-backend megatron"):
        parse_args([*opd])
    with pytest.raises(ConfigError, match="take effect with --use-opd only"):
        parse_args([*MEGA, "--opd-teacher-ckpt-step", "3"])


def test_the_teacher_loads_the_step_opd_teacher_ckpt_step_names(tmp_path):
    from runtime.train.algo import role_paths
    from runtime.train.roles import TEACHER

    root, td = tmp_path / "teacher", make_batch(VOCAB)
    want = {}
    for step, seed in ((3, 1), (9, 2)):  # two teachers of other weights than the student's, at steps 3 and 9
        path = save_model("qwen3", tmp_path / f"teacher{seed}", seed=seed)
        teacher = trainer("megatron", path, job(tmp_path, train_backend="megatron"), roles=(ACTOR,))
        try:
            want[step] = teacher.compute_log_probs(td)[keys.OLD_LOG_PROBS]
            teacher.save_model(str(mck.iteration_folder(root, step)))
        finally:
            teacher.shutdown()
    (root / mck.TRACKER).write_text("9")
    opd = [*MEGA, "--use-opd", "--opd-type", "megatron", "--opd-teacher-load", str(root)]
    student = save_model("qwen3", tmp_path / "student", seed=0)
    for argv, step in ((["--opd-teacher-ckpt-step", "3"], 3), ([], 9)):
        paths = role_paths(parse_args([*opd, *argv]))
        cfg = job(tmp_path, train_backend="megatron")
        mega = trainer("megatron", student, cfg, roles=(ACTOR, TEACHER), role_paths=paths)
        try:
            got = mega.compute_log_probs(td)[keys.TEACHER_LOG_PROBS]
        finally:
            mega.shutdown()
        mask = td[keys.MASK]
        torch.testing.assert_close(got[mask], want[step][mask], rtol=0, atol=1e-6)
        assert not torch.allclose(got[mask], want[12 - step][mask], atol=1e-3)


# -- --megatron-config-path ---------------------------------------------------------------------------------------


def _megatron_yaml(tmp_path, entries) -> str:
    import yaml

    path = tmp_path / "megatron.yaml"
    path.write_text(yaml.safe_dump({"megatron": entries}))
    return str(path)


def test_the_actor_entry_overrides_the_trainers_flags(tmp_path):
    path = _megatron_yaml(
        tmp_path,
        [{"name": "default", "role": "actor", "overrides": {"lr": "2e-5", "eps_clip": 0.3, "num_nodes": 4}}],
    )
    cfg = parse_args([*MEGA, "--megatron-config-path", path, "--lr", "1e-6"])
    assert cfg.train.lr == 2e-5  # the entry wins over the command line, as slime's role args
    assert cfg.algo.eps_clip == 0.3
    assert cfg.resources.actor_num_nodes == 1  # slime ignores num_nodes: GPUs follow the command line
    args_form = _megatron_yaml(tmp_path, [{"role": "actor", "args": {"adam_beta2": 0.95}}])
    assert parse_args([*MEGA, "--megatron-config-path", args_form]).train.adam_beta2 == 0.95
    with pytest.raises(ConfigError, match="--megatron-config-path: a flag of slime's Megatron backend"):
        parse_args(["--megatron-config-path", args_form, "--train-backend", "torch"])
    # Named in a --config YAML (nested by section) instead of on the command line: the same.
    import yaml

    job_yaml = tmp_path / "job.yaml"
    job_yaml.write_text(yaml.safe_dump({"train": {"train_backend": "megatron", "megatron_config_path": args_form}}))
    assert parse_args(["--config", str(job_yaml)]).train.adam_beta2 == 0.95


@pytest.mark.parametrize(
    ("entries", "problem"),
    [
        ([{"role": "critic", "overrides": {"lr": 1e-5}}], "Megatron critic trains with the actor's flags"),
        ([{"role": "actor", "overrides": {"rollout_batch_size": 4}}], "--rollout-batch-size, a flag of the rollout"),
        ([{"role": "actor", "overrides": {"no_such_flag": 1}}], "sets 'no_such_flag', which is no flag"),
        ([{"role": "actor"}, {"role": "actor"}], "2 entries with role actor"),
        ({"role": "actor"}, "needs a top-level 'megatron' list"),
    ],
)
def test_megatron_config_entries_rlcore_cannot_honour_are_refused(entries, problem, tmp_path):
    path = _megatron_yaml(tmp_path, entries)
    with pytest.raises(ConfigError, match=problem):
        parse_args([*MEGA, "--megatron-config-path", path])


def test_the_hf_to_megatron_converter_takes_model_name_and_padded_vocab_size(tmp_path):
    from tools.convert_hf_to_megatron import convert, parse

    path = save_model("qwen3", tmp_path / "m")
    argv = ["--hf-checkpoint", path, "--save", str(tmp_path / "ckpt"), "--model-name", "Qwen3-4B"]
    _, _, flags, _, _ = parse([*argv, "--padded-vocab-size", "384", "--num-layers", "4"])
    assert flags == {"model_name": "Qwen3-4B", "padded_vocab_size": 384, "num_layers": 4}
    folder = convert(path, str(tmp_path / "ckpt"), shape_flags=flags)
    assert mck.read_common(folder)["args"].padded_vocab_size == 384
    assert mck.read_model_tensors(folder)["embedding.word_embeddings.weight"].shape == (384, 48)
    with pytest.raises(ValueError, match="--model-name llama: .*no name for the QK-norms"):
        convert(path, str(tmp_path / "other"), shape_flags={"model_name": "llama"})


def test_the_critic_is_built_by_the_custom_model_provider_too(tmp_path):
    """slime builds the critic through --custom-model-provider-path as well, then swaps its output layer for the
    value head: with roles actor and critic the provider is called twice, and the critic's values equal those of the
    critic rlcore builds itself."""
    from runtime.train.roles import CRITIC

    path = save_model("qwen3", tmp_path / "m")
    td = make_batch(VOCAB)
    ppo = dict(advantage_estimator="ppo", use_kl_loss=False, train_backend="megatron")
    want = _plain(path, tmp_path, td, keys.VALUES, roles=(ACTOR, CRITIC), **ppo)
    hooks = tmp_path / "providers.py"
    hooks.write_text(PROVIDERS)
    cfg = job(tmp_path, custom_model_provider_path=f"{hooks}:counted", **ppo)
    mega = trainer("megatron", path, cfg, roles=(ACTOR, CRITIC), hooks=train_hooks(cfg))
    try:
        assert (tmp_path / "providers.py.calls").read_text().count("call") == 2
        assert torch.equal(mega.compute_log_probs(td)[keys.VALUES], want)
    finally:
        mega.shutdown()
