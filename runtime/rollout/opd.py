"""On-policy distillation from a teacher SGLang server (``--use-opd --opd-type sglang``), slime's
``slime/rollout/on_policy_distillation.py`` pair:

    --custom-rm-path slime.rollout.on_policy_distillation.reward_func
    --custom-reward-post-process-path slime.rollout.on_policy_distillation.post_process_rewards
    --rm-url http://<teacher>/generate

(slime's paths name the functions here; ``runtime.rollout.opd.reward_func`` does too). :func:`reward_func` sends the
whole sample (prompt and response token ids) to the teacher server as slime does: ``max_new_tokens`` 0,
``return_logprob`` with ``logprob_start_len`` 0, at the rollout temperature; SGLang answers with
``meta_info.input_token_logprobs``, one ``[logprob, token_id, text]`` per token (the first one's log-prob None).
The teacher's log-prob of each response token, the last ``response_length`` of them, becomes the sample's
``teacher_log_probs``, which the batch carries to the advantage step: ``A_t -= opd_kl_coef * (old_t - teacher_t)``
(``rlcore.advantages.AdvantageConfig(opd_kl_coef=...)``).

As slime's pair, the task reward is 0 (pure distillation: the signal is the OPD term alone). slime keeps the
teacher's whole answer as the reward and extracts the log-probs in the post-process; here the reward function
extracts them (the answer holds a log-prob per prompt token, too much to keep per sample) and the post-process
returns the zero rewards. The HTTP call is ``--rm-type remote_rm``'s (retries with backoff, ``--reward-timeout`` per
try, ``--http-proxy``). SGLang 0.5.23 takes input log-probs from the raw logits (no temperature): at a rollout
temperature other than 1 the teacher's are those of temperature 1, as in slime.
"""

from __future__ import annotations

from typing import Any

from runtime.rollout.rm_hub import RemoteRewardModel
from runtime.rollout.sample import Sample


def teacher_request(sample: Sample, *, temperature: float) -> dict[str, Any]:
    """slime's ``/generate`` payload asking the teacher for the log-prob of every token of ``sample``."""
    return {
        "input_ids": list(sample.tokens),
        "sampling_params": {"temperature": temperature, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }


def teacher_log_probs(answer: Any, *, response_length: int) -> list[float]:
    """The teacher's log-probs of the last ``response_length`` tokens, from SGLang's answer to
    :func:`teacher_request` (slime's ``input_token_logprobs[1:]``, then the response's tail)."""
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    triples = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    if not isinstance(triples, list) or len(triples) < response_length + 1:
        raise ValueError(
            "the teacher server's answer needs meta_info.input_token_logprobs with one entry per token (sent with "
            f"return_logprob and logprob_start_len 0) covering the {response_length} response tokens; got "
            f"{str(answer)[:200]}"
        )
    values = [t[0] for t in triples[1:]][-response_length:]
    if not all(isinstance(v, int | float) for v in values):
        raise ValueError(f"the teacher's input_token_logprobs hold non-numbers: {values[:8]}")
    return [float(v) for v in values]


async def reward_func(args: Any, sample: Sample, **kwargs: Any) -> float:
    """slime's ``on_policy_distillation.reward_func`` (the teacher server at ``--rm-url``): sets
    ``sample.teacher_log_probs`` and scores 0."""
    if not getattr(args, "rm_url", None):
        raise ValueError("on-policy distillation from a teacher server needs --rm-url (the teacher's /generate)")
    server = RemoteRewardModel(args.rm_url, timeout=args.reward_timeout, proxy=getattr(args, "http_proxy", None))
    answer = await server.post(teacher_request(sample, temperature=args.rollout_temperature))
    sample.teacher_log_probs = teacher_log_probs(answer, response_length=sample.response_length)
    return 0.0


def post_process_rewards(args: Any, samples: list[Sample], **kwargs: Any) -> tuple[list[float], list[float]]:
    """slime's ``on_policy_distillation.post_process_rewards``: the rewards as scored (raw) and 0 for every sample
    (pure distillation)."""
    raw = [float(s.get_reward_value(args)) for s in samples]
    return raw, [0.0] * len(samples)
