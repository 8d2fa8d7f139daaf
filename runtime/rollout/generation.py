"""Rollout: prompts in, scored groups of samples out, with over-sampling and a dynamic-sampling filter.

The default path sends every sample of a round to the engines in one batched call. A custom generate function
(``--custom-generate-function-path``, slime's ``async def generate(args, sample, sampling_params[, evaluation]) ->
Sample | list[Sample]``) is called once per sample instead (with ``evaluation`` when its signature names it; a list
is one prompt's generation split into several training samples that share the group and a ``rollout_id``); inside
it, :func:`generate` (one turn, the default behaviour) and :func:`engine_generate` (raw token ids in, a
:class:`Generation` out) reach the job's engines, the way slime's
custom functions post to its SGLang router. A multi-turn function appends tool output itself and sets
``loss_mask`` 0 on those tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import inspect
import itertools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from runtime.engines.base import Generation, SamplingParams
from runtime.errors import JobError
from runtime.hooks import Hook
from runtime.rollout.filters import FilterFn, filter_groups, reward_value
from runtime.rollout.rewards import RewardHub
from runtime.rollout.sample import Sample

# A filter that keeps rejecting every group would otherwise spin forever.
MAX_SAMPLING_ROUNDS = 32

_STATUS_OF_FINISH = {
    "stop": Sample.Status.COMPLETED,
    "length": Sample.Status.TRUNCATED,
    "abort": Sample.Status.ABORTED,
}


@dataclass
class RolloutContext:
    """What generate functions need: the engines (an ``EngineGroup``), the tokenizer, the job's args, and the
    ``--rollout-sample-hook-path`` hooks that run on every generated sample.

    ``engines`` needs ``async generate(prompts, params, *, session_ids=None) -> list[Generation]`` and ``rewind()``
    (see ``runtime.cluster.engines.EngineGroup``), and ``sampling_seeds=`` too when ``sampling_seed`` is set.

    ``sampling_seed`` (slime's ``--rollout-seed``; set for SGLang engines) gives every sample its own SGLang
    ``sampling_seed``, as slime does: ``sampling_seed + k`` for the k-th sample of its group. It depends on nothing
    but the sample's place in its group, so a resumed job sends the same seeds; SGLang samples by them under
    ``--sglang-enable-deterministic-inference`` (otherwise they only label requests).
    """

    engines: Any
    tokenizer: Any
    args: Any
    # --rollout-sample-hook-path hooks, run on every generated sample before it is scored.
    sample_hooks: Sequence[Callable[..., Any]] = ()
    # For a --rollout-function-path function's generate_and_rm: the custom generate hook, the reward hub and the
    # rollout id it generates for.
    custom_generate: Callable[..., Any] | None = None
    rewards: Any = None
    rollout_id: int | None = None
    sampling_seed: int | None = None

    @property
    def skip_special_tokens(self) -> bool:
        """Whether response texts leave out special tokens (``--rollout-skip-special-tokens``; off in slime, so the
        text keeps e.g. ``<|im_end|>``); True when the args do not say."""
        return bool(getattr(self.args, "rollout_skip_special_tokens", True))


_CONTEXT: contextvars.ContextVar[RolloutContext] = contextvars.ContextVar("rlcore_rollout_context")


@contextlib.contextmanager
def _running(ctx: RolloutContext) -> Iterator[None]:
    """``ctx`` is :func:`current_context` inside the block (generate functions reach the engines through it)."""
    token = _CONTEXT.set(ctx)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def current_context() -> RolloutContext:
    try:
        return _CONTEXT.get()
    except LookupError:
        raise RuntimeError("no rollout is running: engine_generate/generate are for use inside a rollout") from None


async def engine_generate(
    token_ids: list[int], sampling_params: dict[str, Any], *, session_id: str | None = None
) -> Generation:
    """Sample one continuation of ``token_ids`` on the job's engines (for custom generate functions).

    ``session_id`` (a multi-turn sample's ``Sample.session_id``) keeps every turn of a conversation on one SGLang
    server: it is the router's routing key. Engines without a router ignore it. A ``sampling_seed`` key of
    ``sampling_params`` (slime's, which the rollout puts there: see :class:`RolloutContext`) goes along to SGLang.
    """
    sampling_params = dict(sampling_params)
    seed = sampling_params.pop("sampling_seed", None)
    params = SamplingParams.from_dict(sampling_params)
    engines = current_context().engines
    kwargs: dict[str, Any] = {}
    if session_id is not None:
        kwargs["session_ids"] = [session_id]
    if seed is not None:
        kwargs["sampling_seeds"] = [seed]
    return (await engines.generate([list(token_ids)], params, **kwargs))[0]


def apply_generation(
    sample: Sample, generation: Generation, tokenizer: Any, *, skip_special_tokens: bool = True
) -> Sample:
    """``sample`` (a prompt) with ``generation`` appended as its response; returns the same object."""
    sample.tokens = list(sample.tokens) + list(generation.token_ids)
    sample.response_length = len(generation.token_ids)
    sample.response = tokenizer.decode(generation.token_ids, skip_special_tokens=skip_special_tokens)
    sample.rollout_log_probs = list(generation.log_probs)
    sample.loss_mask = [1] * len(generation.token_ids)
    sample.status = _STATUS_OF_FINISH.get(generation.finish_reason, Sample.Status.TRUNCATED)
    # Every version that sampled some of the tokens, in order: more than one when the weights changed while the
    # engine generated (an SGLang server paused around a weight update: ``extra["versions"]``).
    versions = generation.extra.get("versions") or [generation.weight_version]
    sample.weight_versions = [*sample.weight_versions, *(str(v) for v in versions)]
    if "top_p_token_ids" in generation.extra:
        sample.rollout_top_p_token_ids = list(generation.extra["top_p_token_ids"])
        sample.rollout_top_p_token_offsets = list(generation.extra["top_p_token_offsets"])
    if "routed_experts" in generation.extra:
        # The request's whole sequence (a continuation's prompt holds the earlier part): it replaces what was there.
        sample.rollout_routed_experts = generation.extra["routed_experts"]
    return sample


def concat_nuclei(
    first: tuple[list[int], list[int]], second: tuple[list[int], list[int]]
) -> tuple[list[int], list[int]]:
    """Two responses' top-p nuclei in slime's layout (``(token_ids, offsets)``), one after the other: a partial
    rollout's first part and its continuation."""
    (ids_a, offsets_a), (ids_b, offsets_b) = first, second
    return list(ids_a) + list(ids_b), list(offsets_a) + [offsets_a[-1] + o for o in list(offsets_b)[1:]]


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """The default generate function, one sample at a time (slime's signature)."""
    ctx = current_context()
    generation = await engine_generate(sample.tokens, sampling_params, session_id=sample.session_id)
    return apply_generation(sample, generation, ctx.tokenizer, skip_special_tokens=ctx.skip_special_tokens)


def expand_groups(prompts: Sequence[Sample], n_samples: int, *, first_group: int) -> list[list[Sample]]:
    """``n_samples`` copies of each prompt sample, one group per prompt, numbered from ``first_group``."""
    groups = []
    for offset, prompt in enumerate(prompts):
        group = []
        for k in range(n_samples):
            s = copy.deepcopy(prompt)
            s.group_index = first_group + offset
            s.session_id = f"{s.group_index}-{k}"
            group.append(s)
        groups.append(group)
    return groups


def accepted_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``kwargs`` that ``fn`` (a ``Hook``'s function, or any callable) takes by name; all of them when
    it takes ``**kwargs`` (how slime passes optional keywords such as ``evaluation`` and ``rollout_id``)."""
    target = getattr(fn, "fn", fn)
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


async def apply_sample_hooks(
    hooks: Sequence[Callable[..., Any]], args: Any, value: Sample | list[Sample], **kwargs: Any
) -> Sample | list[Sample]:
    """slime's ``--rollout-sample-hook-path`` hooks, in order, on every sample of ``value`` (a generated ``Sample`` or
    a fan-out list of them): ``[async] hook(args, sample, *, rollout_id=None, evaluation=False) -> Sample | None``,
    each given only the keywords its signature names. A returned ``Sample`` replaces the sample; None keeps it."""
    if isinstance(value, list):
        return [await apply_sample_hooks(hooks, args, item, **kwargs) for item in value]
    for hook in hooks:
        out = hook(args, value, **accepted_kwargs(hook, kwargs))
        if inspect.isawaitable(out):
            out = await out
        if out is not None:
            if not isinstance(out, Sample):
                raise _bad_result(hook, f"returned {type(out).__name__} {out!r:.60}, expected a Sample or None")
            value = out
    return value


# Fan-out siblings that a custom generate function left without a rollout id get one of these: negative, so they
# never meet the ids a function sets itself (slime's are sample indices, >= 0).
_AUTO_ROLLOUT_IDS = itertools.count(-1, -1)


def _fan_out(custom_generate: Callable[..., Any], out: list[Any], sample: Sample) -> list[Sample]:
    """The samples of a list result: each a ``Sample``, all sharing one ``rollout_id`` (given, or a fresh one)."""
    if not out:
        raise _bad_result(custom_generate, f"returned an empty list for sample {sample.index}")
    for item in out:
        if not isinstance(item, Sample):
            raise _bad_result(
                custom_generate,
                f"returned a list holding {type(item).__name__} {item!r:.60}, expected Samples",
                kind=TypeError,
            )
    ids = {item.rollout_id for item in out}
    if len(ids) > 1:
        raise _bad_result(
            custom_generate,
            f"returned {len(out)} samples for sample {sample.index} with different rollout_ids "
            f"{sorted(ids, key=str)}: the samples of one rollout share one (the loss averages over the rollout's "
            "tokens once)",
        )
    if ids == {None}:
        shared = next(_AUTO_ROLLOUT_IDS)
        for item in out:
            item.rollout_id = shared
    return out


async def _generate_groups(
    ctx: RolloutContext,
    groups: list[list[Sample]],
    params: SamplingParams,
    custom_generate: Callable[..., Any] | None,
    *,
    evaluation: bool = False,
    rollout_id: int | None = None,
) -> None:
    """Generate every sample of ``groups`` in place. A custom generate function may return a list of samples (one
    prompt's generation split into several training samples, e.g. one per agent turn): they take the place of the
    sample in its group and share a ``rollout_id``. ``ctx.sample_hooks`` run on every result."""
    samples = [s for g in groups for s in g]
    # slime's per-sample seeds (see RolloutContext): by the sample's place in its group.
    seeds = [ctx.sampling_seed + k for g in groups for k in range(len(g))] if ctx.sampling_seed is not None else None
    if custom_generate is None:
        kwargs = {"sampling_seeds": seeds} if seeds is not None else {}
        generations = await ctx.engines.generate([s.tokens for s in samples], params, **kwargs)
        for s, g in zip(samples, generations, strict=True):
            apply_generation(s, g, ctx.tokenizer, skip_special_tokens=ctx.skip_special_tokens)
        results: list[Any] = list(samples)
    else:
        extra = accepted_kwargs(custom_generate, {"evaluation": evaluation})

        async def one(sample: Sample, seed: int | None) -> Any:
            sampling = params.to_dict() if seed is None else {**params.to_dict(), "sampling_seed": seed}
            out = custom_generate(ctx.args, sample, sampling, **extra)
            # slime's hook is an async def; a plain def that returns the sample works as well.
            return await out if inspect.isawaitable(out) else out

        per_sample = seeds or [None] * len(samples)
        results = list(await asyncio.gather(*(one(s, k) for s, k in zip(samples, per_sample, strict=True))))
    if ctx.sample_hooks:
        results = [
            await apply_sample_hooks(ctx.sample_hooks, ctx.args, out, rollout_id=rollout_id, evaluation=evaluation)
            for out in results
        ]
    if custom_generate is None and not ctx.sample_hooks:
        return
    use_tis = _uses_tis(ctx.args)
    check = custom_generate if custom_generate is not None else ctx.sample_hooks[-1]
    k = 0
    for g in groups:
        expanded: list[Sample] = []
        for s in list(g):
            out = results[k]
            k += 1
            if isinstance(out, list):
                pieces = _fan_out(check, out, s)
            elif isinstance(out, Sample):
                pieces = [out]
            else:
                raise _bad_result(
                    check,
                    f"returned {type(out).__name__} {out!r:.60}, expected a Sample or a list of Samples",
                    kind=TypeError,
                )
            for piece in pieces:
                piece.group_index = s.group_index
                if piece.status == Sample.Status.ABORTED:
                    continue  # dropped with its group below, whatever it holds
                if piece.response_length < 1:
                    raise _bad_result(check, f"returned sample {s.index} with an empty response")
                if use_tis and piece.rollout_log_probs is None:
                    raise _bad_result(
                        check,
                        f"returned sample {s.index} with rollout_log_probs None, which --use-tis needs: set "
                        "sample.rollout_log_probs (one per response token; runtime.rollout.engine_generate returns "
                        "them) or run without --use-tis",
                    )
            expanded.extend(pieces)
        # Custom functions may return new Sample objects, or several: put them where the inputs were.
        g[:] = expanded


async def generate_groups(
    ctx: RolloutContext,
    groups: list[list[Sample]],
    params: SamplingParams,
    custom_generate: Callable[..., Any] | None = None,
) -> tuple[list[list[Sample]], list[list[Sample]]]:
    """Generate every sample of ``groups`` (in place) the way a rollout does, custom hook included, inside ``ctx``;
    return :func:`split_aborted` of them: ``(whole, aborted)``. For evaluation, which neither filters nor trains: the
    hooks are called with ``evaluation=True``."""
    with _running(ctx):
        await _generate_groups(ctx, groups, params, custom_generate, evaluation=True)
    return split_aborted(groups)


def _bad_result(custom_generate: Callable[..., Any], what: str, *, kind: type[Exception] = ValueError) -> Exception:
    """A ``HookFailure`` naming the flag and the function when it came from one (a ``Hook``), else ``kind``."""
    if isinstance(custom_generate, Hook):
        return custom_generate.bad_result(what)
    return kind(f"custom generate function {getattr(custom_generate, '__name__', custom_generate)!r} {what}")


def _uses_tis(args: Any) -> bool:
    """``--use-tis`` from the job's ``Config`` (``args.algo.use_tis``) or a flat namespace as slime's."""
    algo = getattr(args, "algo", None)
    return bool(getattr(algo, "use_tis", False) if algo is not None else getattr(args, "use_tis", False))


def split_aborted(groups: list[list[Sample]]) -> tuple[list[list[Sample]], list[list[Sample]]]:
    """``(whole, aborted)``: groups with no ``ABORTED`` sample, and groups with at least one.

    An aborted sample was cut off by the engine, not by a length limit or a stop token: its response is not the
    policy's, and a group missing a member has no fair baseline. As slime does with the groups it aborts, the whole
    group is dropped (not scored, not trained on) and the rollout samples more prompts to fill the batch.
    """
    whole, aborted = [], []
    for g in groups:
        (aborted if any(s.status == Sample.Status.ABORTED for s in g) else whole).append(g)
    return whole, aborted


async def collect_rollout(
    ctx: RolloutContext,
    next_prompts: Callable[[int], list[Sample]],
    hub: RewardHub,
    *,
    rollout_batch_size: int,
    n_samples: int,
    params: SamplingParams,
    over_sampling_batch_size: int | None = None,
    filter_fn: FilterFn | None = None,
    custom_generate: Callable[..., Any] | None = None,
    rollout_id: int | None = None,
    sample_filter: Callable[..., Any] | None = None,
    all_samples_process: tuple[Callable[..., Any], Any] | None = None,
) -> tuple[list[Sample], dict[str, float], dict[str, list[int]]]:
    """Generate, score and filter groups until ``rollout_batch_size`` of them pass.

    Returns ``(samples, metrics, outcomes)``: the kept groups' samples in order, the metrics below, and the prompt
    indices (``Sample.index``) of every group generated but not kept, by outcome: ``filtered`` (the filter dropped
    it), ``discarded`` (it passed after the batch was full) and ``aborted`` (the engine cut a sample of it off), so
    that every prompt handed out is accounted for.

    Each round draws ``over_sampling_batch_size`` prompts (``rollout_batch_size`` when None) from
    ``next_prompts``. Groups with an aborted sample are dropped before scoring (:func:`split_aborted`); groups
    beyond the batch are discarded. Metrics: rounds, groups generated, aborted (and their aborted samples),
    dropped (by the filter's reason) and discarded (passed, but the batch was full), the mean reward of every scored
    sample before the filter, reward errors and timeouts.

    slime's hooks at the end of a rollout: ``sample_filter(args, kept_groups)`` (``--rollout-sample-filter-path``,
    sets ``remove_sample``), then ``process(args, every_scored_group, data_source)`` for ``all_samples_process =
    (process, data_source)`` (``--rollout-all-samples-process-path``: filtered and discarded groups too).
    """
    with _running(ctx):
        ctx.engines.rewind()
        kept: list[list[Sample]] = []
        dropped: Counter[str] = Counter()
        rounds = generated = groups_aborted = samples_aborted = 0
        scored_rewards: list[float] = []
        outcomes: dict[str, list[int]] = {"filtered": [], "discarded": [], "aborted": []}
        every: list[list[Sample]] = []
        while len(kept) < rollout_batch_size:
            if rounds == MAX_SAMPLING_ROUNDS:
                raise JobError(
                    kept_too_few(
                        filter_fn, kept=len(kept), generated=generated, rounds=rounds, need=rollout_batch_size
                    )
                    + f" (drop reasons: {dict(dropped)}; groups with an aborted sample: {groups_aborted})"
                )
            rounds += 1
            groups = expand_groups(
                next_prompts(over_sampling_batch_size or rollout_batch_size), n_samples, first_group=generated
            )
            generated += len(groups)
            await _generate_groups(ctx, groups, params, custom_generate, rollout_id=rollout_id)
            groups, aborted = split_aborted(groups)
            outcomes["aborted"].extend(g[0].index for g in aborted)
            groups_aborted += len(aborted)
            samples_aborted += sum(s.status == Sample.Status.ABORTED for g in aborted for s in g)
            unscored = [s for g in groups for s in g if s.reward is None]
            if unscored:
                # A custom generate function may have filled a reward already (as slime allows).
                await hub.score(unscored)
            scored_rewards.extend(reward_value(s, hub.reward_key) for g in groups for s in g)
            passed, reasons = filter_groups(filter_fn, ctx.args, groups)
            passed_ids = {id(g[0]) for g in passed}
            outcomes["filtered"].extend(g[0].index for g in groups if id(g[0]) not in passed_ids)
            kept.extend(passed)
            dropped.update(reasons)
            every.extend(groups)
    if sample_filter is not None:
        sample_filter(ctx.args, kept[:rollout_batch_size])
    if all_samples_process is not None:
        process, data_source = all_samples_process
        process(ctx.args, every, data_source)
    samples = [s for g in kept[:rollout_batch_size] for s in g]
    outcomes["discarded"] = [g[0].index for g in kept[rollout_batch_size:]]
    metrics: dict[str, float] = {
        "rollout/sampling_rounds": rounds,
        "rollout/groups_generated": generated,
        "rollout/groups_dropped": sum(dropped.values()),
        # Groups that passed the filter but came after the batch was full (over-sampling): generated, not trained.
        "rollout/groups_discarded": max(len(kept) - rollout_batch_size, 0),
        "rollout/groups_aborted": groups_aborted,
        "rollout/samples_aborted": samples_aborted,
        **{f"rollout/dropped/{reason}": count for reason, count in dropped.items()},
        **hub.pop_metrics(),
    }
    metrics.update(sample_metrics(samples, reward_key=hub.reward_key))
    # rollout/reward_mean is over the trained batch (after the filter); this one is over every scored sample.
    if scored_rewards:
        metrics["rollout/reward_mean_before_filter"] = sum(scored_rewards) / len(scored_rewards)
    return samples, metrics, outcomes


def kept_too_few(filter_fn: FilterFn | None, *, kept: int, generated: int, rounds: int | None, need: int) -> str:
    """The one-line report of a rollout that could not fill its batch: the filter (by its flag and path when it is a
    hook) kept ``kept`` of ``generated`` groups (in ``rounds`` sampling rounds, when counted), short of ``need``."""
    if isinstance(filter_fn, Hook):
        who = f"{filter_fn.flag} {filter_fn.path}"
    elif filter_fn is not None:
        who = f"the dynamic sampling filter {getattr(filter_fn, '__name__', filter_fn)!r}"
    else:
        who = "the rollout (no filter)"
    return (
        f"{who} kept {kept} of {generated} groups"
        + (f" in {rounds} sampling rounds" if rounds is not None else "")
        + f", short of --rollout-batch-size {need}: "
        "the job stops (check the filter against a few rewards, or loosen it)"
    )


def reward_category_metrics(samples: Sequence[Sample], key: str, prefix: str = "rollout") -> dict[str, float]:
    """slime's ``--log-reward-category``: the fraction of samples by the value of their dict reward's ``key``
    (``{prefix}/error_cat/<value>``); a sample whose reward has no such entry counts as ``none``."""
    counts: dict[str, int] = {}
    for sample in samples:
        reward = sample.reward if isinstance(sample.reward, dict) else {}
        value = str(reward.get(key, "none"))
        counts[value] = counts.get(value, 0) + 1
    return {f"{prefix}/error_cat/{value}": n / len(samples) for value, n in counts.items()} if samples else {}


def multi_turn_metrics(samples: Sequence[Sample], *, max_response_len: int) -> dict[str, float]:
    """slime's ``--log-multi-turn``: response lengths with the tool output (``raw_response_length/*``: mean, max, min
    and the fraction at ``max_response_len``) and without it (``wo_obs_response_length/*``: the loss-mask sums), and
    ``multi_turn_metric/round_number_*`` when every sample's metadata has a ``round_number``."""
    if not samples:
        return {}
    raw = [s.response_length for s in samples]
    wo_obs = [sum(s.loss_mask) if s.loss_mask is not None else s.response_length for s in samples]
    out = {
        "raw_response_length/response_length_mean": sum(raw) / len(raw),
        "raw_response_length/response_length_max": max(raw),
        "raw_response_length/response_length_min": min(raw),
        "raw_response_length/response_length_clip_ratio": sum(n >= max_response_len for n in raw) / len(raw),
        "wo_obs_response_length/response_length_mean": sum(wo_obs) / len(wo_obs),
        "wo_obs_response_length/response_length_max": max(wo_obs),
        "wo_obs_response_length/response_length_min": min(wo_obs),
    }
    rounds = [s.metadata.get("round_number") for s in samples]
    if all(isinstance(r, int | float) and not isinstance(r, bool) for r in rounds):
        out["multi_turn_metric/round_number_mean"] = sum(rounds) / len(rounds)
        out["multi_turn_metric/round_number_max"] = max(rounds)
        out["multi_turn_metric/round_number_min"] = min(rounds)
    return out


def sample_metrics(
    samples: Sequence[Sample], prefix: str = "rollout", *, reward_key: str | None = None
) -> dict[str, float]:
    rewards = [reward_value(s, reward_key) for s in samples]
    lengths = [s.response_length for s in samples]
    return {
        f"{prefix}/reward_mean": sum(rewards) / len(rewards),
        f"{prefix}/reward_max": max(rewards),
        f"{prefix}/response_len_mean": sum(lengths) / len(lengths),
        f"{prefix}/truncated_frac": sum(s.status == Sample.Status.TRUNCATED for s in samples) / len(samples),
    }
