"""slime's whole-rollout hooks: ``--rollout-function-path``, ``--eval-function-path`` and ``--data-source-path``.

A rollout function has slime's signature, ``generate_rollout(args, rollout_id, data_source, evaluation=False)``, and
returns :class:`RolloutFnTrainOutput` (``samples``: ``list[list[Sample]]``, one list per prompt's group) or, in
evaluation, :class:`RolloutFnEvalOutput` (``data``: ``{name: {"rewards": [...], "truncated": [...], "samples":
[...]}}``); a bare list or dict is taken as slime's legacy form. It runs in a worker thread of its own; inside it,
:func:`run` runs a coroutine on the job's event loop with the engines at hand (slime's ``run``), and
:func:`generate_and_rm` / :func:`generate_and_rm_group` generate and score as the built-in rollout does (the
``--custom-generate-function-path`` and ``--rollout-sample-hook-path`` hooks included), the way slime's functions of
those names do.

The data source it is handed is ``--data-source-path``'s class, built as ``cls(args)``, or by default
:class:`BufferedPromptSource`: the prompt data in groups of ``--n-samples-per-prompt`` copies, after the groups put
back with ``add_samples`` (taken through ``--buffer-filter-path``, first in first out by default), as slime's
``RolloutDataSourceWithBuffer``; with ``--disable-rollout-global-dataset`` it holds those groups only (``len`` 0;
asking for more than the buffer holds raises, as slime's does). A custom data source keeps its own state:
``save(rollout_id)`` is called with every checkpoint and ``load(rollout_id)`` on resume (the rollout id is the last
trained step's, as slime numbers them).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import copy
import itertools
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

from runtime.engines.base import SamplingParams
from runtime.errors import JobError
from runtime.hooks import Hook
from runtime.rollout.generation import (
    RolloutContext,
    _bad_result,
    _generate_groups,
    _running,
    current_context,
    sample_metrics,
)
from runtime.rollout.sample import Sample
from runtime.rollout.source import HANDOUT_KEY, EventLoopThread, Rollout, staleness_metrics

# The class path slime names by default for each flag: given explicitly, they mean the built-in behaviour here.
SLIME_DEFAULT_ROLLOUT = "slime.rollout.sglang_rollout.generate_rollout"
SLIME_DEFAULT_DATA_SOURCE = "slime.rollout.data_source.RolloutDataSourceWithBuffer"


@dataclass
class RolloutFnTrainOutput:
    samples: list[list[Sample]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


def call_rollout_fn(
    fn: Callable[..., Any], *args: Any, evaluation: bool
) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """Call a rollout function as slime does; a legacy bare result is wrapped in the output type."""
    out = fn(*args, evaluation=evaluation)
    if isinstance(out, RolloutFnTrainOutput | RolloutFnEvalOutput):
        return out
    # Duck-typed: slime's own output classes (a plugin that still imports them) have the same fields.
    if hasattr(out, "samples") and not evaluation:
        return RolloutFnTrainOutput(out.samples, getattr(out, "metrics", None))
    if hasattr(out, "data") and evaluation:
        return RolloutFnEvalOutput(out.data, getattr(out, "metrics", None))
    return RolloutFnEvalOutput(data=out) if evaluation else RolloutFnTrainOutput(samples=out)


def flatten_groups(fn: Callable[..., Any], samples: Any) -> list[list[Sample]]:
    """The groups of a rollout function's ``samples``: ``list[list[Sample]]``, or ``list[list[list[Sample]]]`` where
    one generation became several samples (each innermost list must share a ``rollout_id``, as slime asserts; the
    runtime gives them one when all are unset)."""
    if not isinstance(samples, list) or not samples:
        raise _bad_result(
            fn, f"returned samples {type(samples).__name__} {samples!r:.60}, expected list[list[Sample]]"
        )
    groups = []
    for group in samples:
        if isinstance(group, Sample):
            group = [group]
        if not isinstance(group, list):
            raise _bad_result(fn, f"returned a group {type(group).__name__} {group!r:.60}, expected list[Sample]")
        flat: list[Sample] = []
        for item in group:
            if isinstance(item, list):
                ids = {s.rollout_id for s in item}
                if len(item) > 1 and len(ids) > 1:
                    raise _bad_result(
                        fn, f"returned the samples of one rollout with different rollout_ids {sorted(ids, key=str)}"
                    )
                if len(item) > 1 and ids == {None}:
                    shared = next(_AUTO_IDS)
                    for s in item:
                        s.rollout_id = shared
                flat.extend(item)
            else:
                flat.append(item)
        for s in flat:
            if not isinstance(s, Sample):
                raise _bad_result(fn, f"returned {type(s).__name__} {s!r:.60} among the samples, expected Sample")
        groups.append(flat)
    return groups


_AUTO_IDS = itertools.count(-(10**9), -1)
# Where the numbers of samples a rollout function made itself start: above any data source's own numbering.
UNNUMBERED_START = 10**9


def number_groups(groups: list[list[Sample]], numbers: Iterator[int]) -> None:
    """Give the samples a rollout function made itself (slime's ``Sample()`` defaults, ``group_index`` and ``index``
    None) numbers from ``numbers``: one ``group_index`` per group (slime's groups are positional), one ``index`` per
    sample. Numbers already set are kept."""
    for group in groups:
        if any(s.group_index is None for s in group):
            shared = next(numbers)
            for s in group:
                if s.group_index is None:
                    s.group_index = shared
        for s in group:
            if s.index is None:
                s.index = next(numbers)


def pop_first(args: Any, rollout_id: Any, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """slime's default buffer filter: the first ``num_samples`` groups of the buffer, removed from it."""
    taken = buffer[:num_samples]
    del buffer[:num_samples]
    return taken


class BufferedPromptSource:
    """The default data source of a rollout function (slime's ``RolloutDataSourceWithBuffer``): groups put back with
    :meth:`add_samples` first (through ``buffer_filter``), then the prompt feed's next prompts, each as a group of
    ``n_samples`` copies numbered by ``group_index`` and ``index``. Its position and buffer go into the job's
    checkpoints (:meth:`state_dict`), so :meth:`save` and :meth:`load` have nothing left to do."""

    def __init__(self, feed: Any, args: Any, *, n_samples: int, buffer_filter: Callable[..., Any] | None = None):
        self.feed, self.args, self.n_samples = feed, args, n_samples
        self.buffer_filter = buffer_filter or pop_first
        self.buffer: list[list[Sample]] = []
        self.sample_group_index = 0
        self.sample_index = 0
        self.handouts: list[int] = []

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        groups = list(self.buffer_filter(self.args, None, self.buffer, num_samples)) if self.buffer else []
        if num_samples > len(groups) and self.feed is None:
            raise RuntimeError(
                f"get_samples({num_samples}): the buffer holds {len(groups)} groups and --disable-rollout-global-"
                "dataset leaves the data source no prompt data: add_samples more groups first, or drop the flag"
            )
        prompts = self.feed.take(num_samples - len(groups)) if num_samples > len(groups) else []
        for prompt in prompts:
            self.handouts.append(prompt.metadata[HANDOUT_KEY])
            group = []
            for _ in range(self.n_samples):
                s = copy.deepcopy(prompt)
                s.group_index, s.index = self.sample_group_index, self.sample_index
                s.metadata = {**s.metadata, "prompt_index": prompt.index}
                self.sample_index += 1
                group.append(s)
            self.sample_group_index += 1
            groups.append(group)
        return groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        if not samples:
            return
        for group in samples:
            if not isinstance(group, list) or len(group) != self.n_samples:
                raise ValueError(
                    f"add_samples takes groups of --n-samples-per-prompt {self.n_samples} samples, got "
                    f"{type(group).__name__} of {len(group) if isinstance(group, list) else '?'}"
                )
            self.buffer.append(group)

    def save(self, rollout_id: int) -> None:
        pass

    def load(self, rollout_id: int | None = None) -> None:
        pass

    def __len__(self) -> int:
        return 0 if self.feed is None else len(self.feed.dataset)

    def get_buffer_length(self) -> int:
        return len(self.buffer)

    def state_dict(self) -> dict[str, Any]:
        return {
            "buffer": copy.deepcopy(self.buffer),
            "sample_group_index": self.sample_group_index,
            "sample_index": self.sample_index,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer = copy.deepcopy(state["buffer"])
        self.sample_group_index, self.sample_index = state["sample_group_index"], state["sample_index"]


class JobData:
    """What a checkpoint holds of the job's data: the prompt feed, and the data source when it is the default one
    (a custom one saves itself with ``save(rollout_id)``, called by :meth:`on_save`)."""

    def __init__(self, feed: Any, data_source: Any = None):
        self.feed, self.data_source = feed, data_source

    @property
    def dataset(self) -> Any:
        return self.feed.dataset

    def state_dict(self) -> dict[str, Any]:
        state = self.feed.state_dict()
        if isinstance(self.data_source, BufferedPromptSource):
            state = {**state, "data_source": self.data_source.state_dict()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.feed.load_state_dict(state)
        if isinstance(self.data_source, BufferedPromptSource) and "data_source" in state:
            self.data_source.load_state_dict(state["data_source"])

    def on_save(self, step: int) -> None:
        """After a checkpoint of ``step`` completed steps: a custom data source saves its state under slime's
        rollout id (the last trained step, ``step - 1``)."""
        if self.data_source is not None and not isinstance(self.data_source, BufferedPromptSource):
            self.data_source.save(step - 1)

    def on_load(self, step: int) -> None:
        if self.data_source is not None and not isinstance(self.data_source, BufferedPromptSource):
            self.data_source.load(step - 1)


# -- inside a rollout function (its worker thread) -----------------------------------------------------------------

_JOB: contextvars.ContextVar[tuple[EventLoopThread, RolloutContext]] = contextvars.ContextVar("rlcore_rollout_job")


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` on the job's event loop, with the engines and hooks at hand, and return its result (slime's
    ``slime.utils.async_utils.run``). For use inside a ``--rollout-function-path`` function."""
    try:
        runner, ctx = _JOB.get()
    except LookupError:
        raise RuntimeError("runtime.rollout.run is for use inside a --rollout-function-path function") from None

    async def inside() -> Any:
        with _running(ctx):
            return await coro

    return runner.submit(inside()).result()


def rollout_tokenizer() -> Any:
    """The job's tokenizer, inside a ``--rollout-function-path`` function."""
    try:
        return _JOB.get()[1].tokenizer
    except LookupError:
        raise RuntimeError("rollout_tokenizer is for use inside a --rollout-function-path function") from None


async def generate_and_rm(
    args: Any, sample: Sample | list[Sample], sampling_params: dict[str, Any], evaluation: bool = False
) -> Sample | list[Sample]:
    """Generate one sample the way the job's rollout does (custom generate and sample hooks included) and score it
    (slime's function of this name); a fan-out returns its list. Samples already holding a reward keep it."""
    ctx = current_context()
    group = [sample] if isinstance(sample, Sample) else list(sample)
    groups = [group]
    params = SamplingParams.from_dict(sampling_params)
    await _generate_groups(ctx, groups, params, ctx.custom_generate, evaluation=evaluation, rollout_id=ctx.rollout_id)
    out = groups[0]
    unscored = [s for s in out if s.reward is None and s.status != Sample.Status.ABORTED]
    if unscored:
        await ctx.rewards.score(unscored)
    return out[0] if isinstance(sample, Sample) and len(out) == 1 else out


async def generate_and_rm_group(
    args: Any, group: list[Sample], sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Sample]:
    """:func:`generate_and_rm` over one prompt's group, concurrently; fan-outs are flattened into the group."""
    results = await asyncio.gather(*(generate_and_rm(args, s, dict(sampling_params), evaluation) for s in group))
    return [x for r in results for x in (r if isinstance(r, list) else [r])]


class HookSource:
    """The ``RolloutSource`` of a ``--rollout-function-path`` function: each step's rollout is one call of it,
    ``fn(args, step, data_source, evaluation=False)``, in a worker thread, started when the step is asked for (or,
    with ``lookahead`` 1, one step ahead). Samples it leaves unscored are scored by the job's reward. As in slime,
    the end-of-rollout hooks (``--rollout-sample-filter-path``, ``--rollout-all-samples-process-path``) belong to the
    built-in rollout: a rollout function calls what it needs itself."""

    def __init__(
        self,
        runner: EventLoopThread,
        ctx: RolloutContext,
        fn: Callable[..., Any],
        data_source: Any,
        *,
        num_rollout: int,
        lookahead: int = 0,
    ):
        self.runner, self.ctx, self.fn, self.data_source = runner, ctx, fn, data_source
        self.num_rollout, self.lookahead = num_rollout, lookahead
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-fn")
        self._futures: collections.OrderedDict[int, concurrent.futures.Future] = collections.OrderedDict()
        self._numbers = itertools.count(UNNUMBERED_START)

    def start(self, step: int) -> None:
        pass

    def _submit(self, step: int) -> None:
        ctx = RolloutContext(**{**vars(self.ctx), "rollout_id": step})

        def call() -> Rollout:
            token = _JOB.set((self.runner, ctx))
            try:
                handouts_before = len(getattr(self.data_source, "handouts", []))
                out = call_rollout_fn(self.fn, ctx.args, step, self.data_source, evaluation=False)
                if not isinstance(out, RolloutFnTrainOutput):
                    raise _bad_result(self.fn, f"returned {type(out).__name__}, expected RolloutFnTrainOutput")
                groups = flatten_groups(self.fn, out.samples)
                number_groups(groups, self._numbers)
                handouts = list(getattr(self.data_source, "handouts", [])[handouts_before:])
            finally:
                _JOB.reset(token)
            unscored = [s for g in groups for s in g if s.reward is None]
            if unscored:
                self.runner.run(ctx.rewards.score(unscored))
            for g in groups:
                for s in g:
                    if s.response_length < 1 or len(s.tokens) <= s.response_length:
                        raise _bad_result(
                            self.fn,
                            f"returned sample {s.index} with response_length {s.response_length} of "
                            f"{len(s.tokens)} tokens (a response needs a prompt token before it)",
                        )
            samples = [s for g in groups for s in g]
            metrics = {k: float(v) for k, v in (out.metrics or {}).items() if isinstance(v, int | float)}
            metrics.update(ctx.rewards.pop_metrics())
            metrics.update(sample_metrics(samples, reward_key=ctx.rewards.reward_key))
            return Rollout(step, samples, metrics, handouts=handouts)

        self._futures[step] = self._pool.submit(call)

    def get(self, step: int) -> Rollout:
        if step not in self._futures:
            self._submit(step)
        try:
            rollout = self._futures.pop(step).result()
        except JobError:
            raise
        except Exception as err:
            if isinstance(self.fn, Hook):
                raise self.fn.failure(err) from err
            raise
        ahead = step + self.lookahead
        if self.lookahead and ahead < self.num_rollout and ahead not in self._futures:
            self._submit(ahead)
        rollout.metrics.update(staleness_metrics(rollout.samples, step=step))
        return rollout

    def pause(self) -> None:
        concurrent.futures.wait(list(self._futures.values()))

    def resume(self, version: int) -> None:
        pass

    def commit(self, rollout: Rollout) -> None:
        feed = getattr(self.data_source, "feed", None)
        if feed is not None:
            feed.commit(rollout.handouts)

    def close(self) -> None:
        for future in self._futures.values():
            future.cancel()
        self._futures.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)


def evaluate_with(
    runner: EventLoopThread, ctx: RolloutContext, fn: Callable[..., Any], data_source: Any, step: int
) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
    """One ``--eval-function-path`` call (``evaluation=True``) in a worker thread: its ``data`` and the metrics
    ``eval/{name}/reward_mean``, ``eval/{name}/truncated_frac`` per dataset (plus the function's own metrics)."""
    ctx = RolloutContext(**{**vars(ctx), "rollout_id": step})

    def call() -> RolloutFnEvalOutput:
        token = _JOB.set((runner, ctx))
        try:
            return call_rollout_fn(fn, ctx.args, step, data_source, evaluation=True)
        finally:
            _JOB.reset(token)

    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval-fn") as pool:
        try:
            out = pool.submit(call).result()
        except JobError:
            raise
        except Exception as err:
            if isinstance(fn, Hook):
                raise fn.failure(err) from err
            raise
    if not isinstance(out, RolloutFnEvalOutput) or not isinstance(out.data, dict):
        raise _bad_result(fn, f"returned {type(out).__name__}, expected RolloutFnEvalOutput(data={{name: ...}})")
    metrics: dict[str, float] = {}
    for name, entry in out.data.items():
        rewards = [float(r) for r in entry.get("rewards", [])]
        if rewards:
            metrics[f"eval/{name}/reward_mean"] = sum(rewards) / len(rewards)
        truncated = entry.get("truncated")
        if truncated:
            metrics[f"eval/{name}/truncated_frac"] = sum(map(bool, truncated)) / len(truncated)
    metrics.update({f"eval/{k}": float(v) for k, v in (out.metrics or {}).items() if isinstance(v, int | float)})
    return out.data, metrics


class DataSourceFeed:
    """The built-in rollout's prompt feed over a ``--data-source-path`` data source: each group it returns gives one
    prompt (its first sample), which the rollout copies ``--n-samples-per-prompt`` times. The data source keeps its
    own position (``save`` / ``load``), so the feed's books are its hand-out counter only."""

    def __init__(self, data_source: Any, dataset: Any):
        self.data_source, self.dataset = data_source, dataset
        self._next = 0

    def take(self, n: int) -> list[Sample]:
        prompts = []
        for group in self.data_source.get_samples(n):
            prompt = copy.deepcopy(group[0] if isinstance(group, list) else group)
            prompt.metadata = {**prompt.metadata, HANDOUT_KEY: self._next}
            self._next += 1
            prompts.append(prompt)
        return prompts

    def commit(self, handouts: list[int]) -> None:
        pass

    @property
    def num_outstanding(self) -> int:
        return 0

    def state_dict(self) -> dict[str, Any]:
        return {"next": self._next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._next = int(state.get("next", 0))


@dataclass
class RolloutHooks:
    """The driver-side hooks of a job, each resolved from its flag before Ray starts (None or empty when unset)."""

    custom_generate: Hook | None = None
    sample_hooks: tuple[Hook, ...] = ()
    sample_filter: Hook | None = None
    all_samples_process: Hook | None = None
    rollout_fn: Hook | None = None
    eval_fn: Hook | None = None
    data_source_cls: Hook | None = None
    buffer_filter: Hook | None = None
    reward_post_process: Hook | None = None
    convert_samples: Hook | None = None
    rollout_log: Hook | None = None
    eval_log: Hook | None = None


def _maybe(name: str, path: str | None) -> Hook | None:
    from runtime.config import flag
    from runtime.hooks import resolve_hook

    return resolve_hook(flag(name), path) if path else None


def load_rollout_hooks(cfg: Any) -> RolloutHooks:
    """Resolve every driver-side hook flag of ``cfg`` (slime's default paths mean the built-in behaviour)."""
    r, rw = cfg.rollout, cfg.reward
    rollout_path = None if r.rollout_function_path == SLIME_DEFAULT_ROLLOUT else r.rollout_function_path
    source_path = None if cfg.data.data_source_path == SLIME_DEFAULT_DATA_SOURCE else cfg.data.data_source_path
    rollout_fn = _maybe("rollout_function_path", rollout_path)
    # slime's --eval-function-path defaults to the rollout function.
    eval_path = None if r.eval_function_path == SLIME_DEFAULT_ROLLOUT else r.eval_function_path
    eval_fn = _maybe("eval_function_path", eval_path) or rollout_fn
    if rollout_fn is None and cfg.algo.loss_type == "sft_loss":
        # Ours: --loss-type sft_loss alone runs slime's SFT rollout (its scripts name it with --rollout-function-path).
        rollout_fn = _maybe("rollout_function_path", "runtime.rollout.sft:generate_rollout")
    return RolloutHooks(
        custom_generate=_maybe("custom_generate_function_path", r.custom_generate_function_path),
        sample_hooks=tuple(_maybe("rollout_sample_hook_path", p) for p in r.rollout_sample_hook_path),
        sample_filter=_maybe("rollout_sample_filter_path", r.rollout_sample_filter_path),
        all_samples_process=_maybe("rollout_all_samples_process_path", r.rollout_all_samples_process_path),
        rollout_fn=rollout_fn,
        eval_fn=eval_fn,
        data_source_cls=_maybe("data_source_path", source_path),
        buffer_filter=_maybe("buffer_filter_path", r.buffer_filter_path),
        reward_post_process=_maybe("custom_reward_post_process_path", rw.custom_reward_post_process_path),
        convert_samples=_maybe(
            "custom_convert_samples_to_train_data_path", rw.custom_convert_samples_to_train_data_path
        ),
        rollout_log=_maybe("custom_rollout_log_function_path", r.custom_rollout_log_function_path),
        eval_log=_maybe("custom_eval_rollout_log_function_path", r.custom_eval_rollout_log_function_path),
    )


def builtin_rollout(
    args: Any, rollout_id: int, data_source: Any, evaluation: bool = False
) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """A rollout function with slime's signature over the job's generation and reward (what slime's default path,
    ``slime.rollout.sglang_rollout.generate_rollout``, names here): ``--rollout-batch-size`` groups from
    ``data_source``, each generated and scored by :func:`generate_and_rm_group`, for rollout functions that wrap it.
    Given as ``--rollout-function-path`` itself, the built-in rollout (over-sampling and filters included) runs."""
    if evaluation:
        raise ValueError("builtin_rollout generates training rollouts; evaluation runs the built-in evaluation")
    try:
        ctx = _JOB.get()[1]
    except LookupError:
        raise RuntimeError("builtin_rollout runs inside a --rollout-function-path function") from None
    params = {
        "max_new_tokens": ctx.args.rollout_max_response_len,
        "temperature": ctx.args.rollout_temperature,
        "top_p": ctx.args.rollout_top_p,
        "top_k": ctx.args.rollout_top_k,
        "stop_token_ids": list(ctx.args.rollout_stop_token_ids or ()),
    }
    groups = data_source.get_samples(ctx.args.rollout_batch_size)

    async def all_groups() -> list[list[Sample]]:
        return list(await asyncio.gather(*(generate_and_rm_group(args, g, params) for g in groups)))

    return RolloutFnTrainOutput(samples=run(all_groups()))
