"""``--use-opd --opd-type sglang``: on-policy distillation from a teacher SGLang server, through slime's
``on_policy_distillation`` reward pair, against the strict fake server (payloads checked against SGLang's own
request classes). The teacher's log-probs are checked against a float64 forward of the teacher model, and through a
real job against the OPD term of the advantages (``train/opd_reverse_kl``)."""

import asyncio
import math

import pytest
import torch
from fake_sglang import FakeSGLangServer
from transformers import AutoModelForCausalLM

from runtime.config import ConfigError, from_dict, parse_args, validate
from runtime.demo import task
from runtime.demo.tiny_model import make_tiny_model
from runtime.hooks import load_function
from runtime.logger import METRICS_FILE, read_metrics
from runtime.loop import run
from runtime.rollout import opd
from runtime.rollout.sample import Sample
from runtime.train.batch import build_batch

OPD = [
    "--use-opd",
    "--opd-type",
    "sglang",
    "--custom-rm-path",
    "slime.rollout.on_policy_distillation.reward_func",
    "--custom-reward-post-process-path",
    "slime.rollout.on_policy_distillation.post_process_rewards",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(student, teacher): two tiny models of one tokenizer with different weights."""
    root = tmp_path_factory.mktemp("opd")
    return tuple(
        str(make_tiny_model(root / name, alphabet=task.ALPHABET, seed=seed)) for name, seed in (("s", 0), ("t", 1))
    )


@pytest.fixture(scope="module")
def teacher(models):
    with FakeSGLangServer(models[1], seed=0) as server:
        yield server


@torch.no_grad()
def _teacher_reference(path: str, tokens: list[int], response_length: int) -> torch.Tensor:
    """float64 log_softmax of the teacher's logits at each response token (temperature 1, as SGLang's input
    log-probs)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    logits = model(input_ids=torch.tensor([tokens])).logits[0]
    full = torch.log_softmax(logits, -1)
    positions = range(len(tokens) - response_length, len(tokens))
    return torch.tensor([full[p - 1, tokens[p]] for p in positions], dtype=torch.float64)


def test_slimes_paths_name_the_counterparts():
    assert load_function("slime.rollout.on_policy_distillation.reward_func") is opd.reward_func
    assert load_function("slime.rollout.on_policy_distillation.post_process_rewards") is opd.post_process_rewards


def test_reward_func_asks_the_teacher_server_and_sets_teacher_log_probs(models, teacher):
    args = parse_args([*OPD, "--rm-url", f"{teacher.url}/generate"])
    tokens = [1, 5, 6, 7, 8, 9, 10, 2]
    sample = Sample(group_index=0, index=0, tokens=tokens, response_length=3)
    before = teacher.requests.get("/generate", 0)
    assert asyncio.run(opd.reward_func(args, sample)) == 0.0
    assert teacher.requests["/generate"] == before + 1  # one request, which the strict server accepted
    ref = _teacher_reference(models[1], tokens, 3)
    torch.testing.assert_close(torch.tensor(sample.teacher_log_probs, dtype=torch.float64), ref, atol=1e-5, rtol=0)
    # slime's post-process: raw rewards as scored, 0 to train on.
    sample.reward = 0.0
    assert opd.post_process_rewards(args, [sample]) == ([0.0], [0.0])
    # The batch carries them to the trainers.
    sample.rollout_log_probs = [-1.0] * 3
    td = build_batch([sample], pad_token_id=0, teacher_log_probs=True)
    torch.testing.assert_close(td["teacher_log_probs"][0].double(), ref, atol=1e-5, rtol=0)


def test_the_answer_must_hold_the_prompts_log_probs():
    with pytest.raises(ValueError, match="needs meta_info.input_token_logprobs"):
        opd.teacher_log_probs({"meta_info": {"output_token_logprobs": []}}, response_length=2)
    answer = {"meta_info": {"input_token_logprobs": [[None, 1, None], [-0.5, 2, None], [-1.5, 3, None]]}}
    assert opd.teacher_log_probs(answer, response_length=2) == [-0.5, -1.5]
    assert opd.teacher_log_probs(answer, response_length=1) == [-1.5]


def test_a_sample_without_teacher_log_probs_is_named():
    s = Sample(group_index=0, index=4, tokens=[1, 2, 3], response_length=2, reward=0.0)
    with pytest.raises(ValueError, match="sample 0 .index 4. has no teacher_log_probs for its 2 response tokens"):
        build_batch([s], pad_token_id=0, teacher_log_probs=True)


def test_opd_sglang_needs_what_fills_the_teacher_log_probs():
    with pytest.raises(ConfigError, match="--opd-type sglang trains on each sample's teacher_log_probs"):
        parse_args(["--use-opd", "--opd-type", "sglang"])
    with pytest.raises(ConfigError, match="--opd-teacher-load is for --opd-type megatron"):
        parse_args([*OPD, "--rm-url", "http://127.0.0.1:1/generate", "--opd-teacher-load", "/x"])
    cfg = parse_args([*OPD, "--rm-url", "http://127.0.0.1:1/generate"])
    assert cfg.algo.use_opd and cfg.algo.opd_type == "sglang"


def test_a_job_distills_from_the_teacher_server(ray_session, models, teacher, tmp_path):
    dump = str(tmp_path / "train_{rollout_id}.pt")
    cfg = validate(
        from_dict(
            None,
            output_dir=str(tmp_path / "out"),
            hf_checkpoint=models[0],
            num_rollout=2,
            rollout_batch_size=4,
            n_samples_per_prompt=4,
            rollout_max_response_len=5,
            global_batch_size=16,
            micro_batch_size=8,
            actor_num_gpus_per_node=1,
            use_tensorboard=False,
            use_kl_loss=False,
            use_opd=True,
            opd_type="sglang",
            opd_kl_coef=0.5,
            custom_rm_path="slime.rollout.on_policy_distillation.reward_func",
            custom_reward_post_process_path="slime.rollout.on_policy_distillation.post_process_rewards",
            rm_url=f"{teacher.url}/generate",
            save_debug_train_data=dump,
        )
    )
    rows = read_metrics(run(cfg, progress=False).output_dir / METRICS_FILE)
    assert [row["reward/errors"] for row in rows] == [0, 0]
    batch = torch.load(dump.format(rollout_id=0), weights_only=False)["batch"]
    mask = batch["mask"]
    student = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float64)
    gaps, reverse_kl = [], []
    for i in range(mask.shape[0]):
        total = int(batch["prompt_lengths"][i] + batch["response_lengths"][i])
        r = int(batch["response_lengths"][i])
        tokens = batch["tokens"][i, :total].tolist()
        teacher_ref = _teacher_reference(models[1], tokens, r)
        gaps.append((batch["teacher_log_probs"][i, :r].double() - teacher_ref).abs().max())
        with torch.no_grad():
            full = torch.log_softmax(student(input_ids=torch.tensor([tokens])).logits[0], -1)
        own = torch.tensor([full[p - 1, tokens[p]] for p in range(total - r, total)], dtype=torch.float64)
        reverse_kl.append(own - teacher_ref)
    assert max(gaps) < 1e-5
    # The step's OPD term: the mean over valid tokens of student minus teacher log-probs (before training).
    expected = torch.cat(reverse_kl).mean().item()
    assert rows[0]["train/opd_reverse_kl"] == pytest.approx(expected, abs=1e-4)
    # The teacher is another model: per token the two differ (the signed mean depends on which tokens were drawn).
    assert torch.cat(reverse_kl).abs().mean().item() > 0.05 and math.isfinite(rows[1]["train/opd_reverse_kl"])
    # Pure distillation: the rewards are 0, so the advantages are the OPD term alone, -0.5 x (student - teacher).
    assert float(batch["rewards"].abs().max()) == 0.0
    assert rows[0]["rollout/advantage_abs_mean"] == pytest.approx(
        0.5 * torch.cat(reverse_kl).abs().mean().item(), abs=1e-4
    )
