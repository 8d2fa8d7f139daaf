"""Rollout sources: where the loop gets each step's scored, filtered groups, on one long-lived event loop.

The loop asks a :class:`RolloutSource` for step ``s``'s rollout (:meth:`RolloutSource.get`) and brackets every weight
update with :meth:`RolloutSource.pause` / :meth:`RolloutSource.resume`. Sync, one-step-async and fully-async training
are this one loop with a different source, picked by ``--rollout-schedule`` from :data:`SCHEDULES`:

- ``sync``: step ``s``'s rollout is generated when the loop asks for it; nothing generates while the trainers train.
- ``one_step`` (slime's ``train_async.py``): as soon as step ``s``'s rollout is handed over, step ``s + 1``'s starts,
  so it is generated while step ``s`` trains, with the weights of before step ``s``. A weight update waits for it to
  finish (generation is drained at the sync, :meth:`BatchSource.pause`), so its samples are exactly one weight version
  behind, unless the loop syncs without waiting: staged into the embedded engines' second buffer and swapped in before
  the next rollout (:meth:`BatchSource.defer`), or with SGLang servers paused around the sync, when the tokens sampled
  after it are the new version's (``runtime.loop.sync_weights``).
- ``fully_async``: a producer keeps admitting groups across steps while the trainers train; each step takes the next
  ``--rollout-batch-size`` groups that pass the filter, in the order they were admitted. Staleness is bounded by
  admission, not by dropping stale groups afterwards (which would bias the data toward short responses): a group is
  admitted at engine version ``v`` only if it will be trained by step ``v + --max-staleness``. At a weight update
  running generations are drained, or with ``--partial-rollout`` cut off (``RolloutEngine.abort``) and resumed with
  the new weights, their tokens joined (``--mask-offpolicy-in-partial-rollout`` takes the part sampled with the old
  weights out of the loss).

Every prompt handed out is tracked by the :class:`PromptFeed` until the step that consumed it is committed: a
checkpoint stores the data position plus every prompt handed out but not yet committed (in flight, buffered or
partial), and a resumed job hands those out again first, so over an epoch every prompt is trained (or recorded as
filtered, discarded or aborted) exactly once.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import dataclasses
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from runtime.engines.base import SamplingParams
from runtime.errors import JobError
from runtime.rollout.filters import FilterFn, filter_groups
from runtime.rollout.generation import (
    MAX_SAMPLING_ROUNDS,
    RolloutContext,
    _generate_groups,
    _running,
    apply_generation,
    collect_rollout,
    concat_nuclei,
    expand_groups,
    kept_too_few,
    sample_metrics,
    split_aborted,
)
from runtime.rollout.rewards import RewardHub
from runtime.rollout.sample import Sample

# The metadata key of a prompt's hand-out number: unique within a job (resumes included), it names the prompt in
# the feed's books.
HANDOUT_KEY = "rlcore_handout"
OUTCOMES = ("filtered", "discarded", "aborted")


@dataclass
class Rollout:
    """One step's rollout: the samples to train on (groups in order), metrics, and the prompts it settled.

    ``handouts``: the hand-out numbers of every prompt this rollout consumed (trained or not); ``outcomes``: the
    dataset indices of the prompts generated but not trained, by reason (see :data:`OUTCOMES`).
    """

    step: int
    samples: list[Sample]
    metrics: dict[str, float]
    handouts: list[int] = field(default_factory=list)
    outcomes: dict[str, list[int]] = field(default_factory=dict)

    @property
    def trained_indices(self) -> list[int]:
        """Dataset indices of the trained prompts, one per group, in order."""
        return [
            s.index for i, s in enumerate(self.samples) if i == 0 or s.group_index != self.samples[i - 1].group_index
        ]


def staleness_metrics(samples: list[Sample], *, step: int) -> dict[str, float]:
    """Weight-version lag of ``samples`` trained at ``step`` (the trainers hold version ``step`` then): the step minus
    the oldest version that sampled any of a sample's tokens, mean and max over samples."""
    lags = [step - min(int(v) for v in s.weight_versions) for s in samples if s.weight_versions]
    if not lags:
        return {}
    return {"rollout/weight_version_lag_mean": sum(lags) / len(lags), "rollout/weight_version_lag_max": max(lags)}


class PromptFeed:
    """Prompts handed out to rollouts, and the books that make a resume lose and repeat nothing.

    ``take(n)`` hands out prompts: those a resumed checkpoint returned first, then the dataset's next ones. Each gets
    a hand-out number (``metadata[HANDOUT_KEY]``) and stays outstanding until :meth:`commit` settles it (the loop
    commits a step's rollout once the step is trained).
    """

    def __init__(self, dataset: Any):
        self.dataset = dataset
        self._returned: collections.deque[Sample] = collections.deque()
        self._outstanding: dict[int, Sample] = {}
        self._next = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> list[Sample]:
        with self._lock:
            out = [self._returned.popleft() for _ in range(min(n, len(self._returned)))]
            fresh = self.dataset.next_batch(n - len(out)) if n > len(out) else []
            for prompt in fresh:
                prompt.metadata[HANDOUT_KEY] = self._next
                self._next += 1
            out.extend(fresh)
            for prompt in out:
                self._outstanding[prompt.metadata[HANDOUT_KEY]] = copy.deepcopy(prompt)
            return out

    def commit(self, handouts: list[int]) -> None:
        with self._lock:
            for h in handouts:
                self._outstanding.pop(h, None)

    @property
    def num_outstanding(self) -> int:
        return len(self._outstanding) + len(self._returned)

    def state_dict(self) -> dict[str, Any]:
        """The data position, the next hand-out number, and every outstanding prompt in hand-out order."""
        with self._lock:
            pending = sorted([*self._outstanding.values(), *self._returned], key=lambda s: s.metadata[HANDOUT_KEY])
            return {"data": self.dataset.state_dict(), "next": self._next, "outstanding": copy.deepcopy(pending)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self.dataset.load_state_dict(state["data"])
            self._next = int(state["next"])
            self._outstanding = {}
            self._returned = collections.deque(copy.deepcopy(state["outstanding"]))


class EventLoopThread:
    """One asyncio event loop in a daemon thread for the whole job: rollouts, rewards and evaluation run on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollout-loop", daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on the loop and wait for its result (exceptions propagate)."""
        return self.submit(coro).result()

    def close(self) -> None:
        if self.loop.is_closed():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


@dataclass(frozen=True)
class RolloutSettings:
    """What every source needs to know of the job (from the config: slime's rollout flags)."""

    rollout_batch_size: int
    n_samples: int
    params: SamplingParams | None  # None: the job generates nothing (slime's SFT rollout, no response length)
    num_rollout: int
    over_sampling_batch_size: int | None = None
    max_staleness: int = 1
    partial_rollout: bool = False
    mask_offpolicy_in_partial_rollout: bool = False


@runtime_checkable
class RolloutSource(Protocol):
    def start(self, step: int) -> None:
        """Begin producing from ``step`` (the job's first step, or the one a resume continues at)."""
        ...

    def get(self, step: int) -> Rollout:
        """Step ``step``'s rollout (waits until it is ready); steps are asked for in order."""
        ...

    def pause(self) -> None:
        """Before a weight update: no generation runs until :meth:`resume` (drained, or cut off for partial
        rollout)."""
        ...

    def resume(self, version: int) -> None:
        """After a weight update: the engines sample with ``version`` now; generation goes on."""
        ...

    def commit(self, rollout: Rollout) -> None:
        """``rollout`` is trained: its prompts leave the feed's books."""
        ...

    def close(self) -> None: ...


class _Source:
    """What the sources share: the feed, the rollout context, the reward hub, the filter and hooks."""

    def __init__(
        self,
        runner: EventLoopThread,
        feed: PromptFeed,
        ctx: RolloutContext,
        hub: RewardHub,
        settings: RolloutSettings,
        *,
        filter_fn: FilterFn | None = None,
        custom_generate: Callable[..., Any] | None = None,
        sample_filter: Callable[..., Any] | None = None,
        all_samples_process: tuple[Callable[..., Any], Any] | None = None,
    ):
        self.runner, self.feed, self.ctx, self.hub, self.settings = runner, feed, ctx, hub, settings
        self.filter_fn, self.custom_generate = filter_fn, custom_generate
        # slime's end-of-rollout hooks (--rollout-sample-filter-path, --rollout-all-samples-process-path).
        self.sample_filter, self.all_samples_process = sample_filter, all_samples_process

    def commit(self, rollout: Rollout) -> None:
        self.feed.commit(rollout.handouts)


class BatchSource(_Source):
    """``sync`` (``lookahead=0``) and ``one_step`` (``lookahead=1``): each step's rollout is one
    :func:`runtime.rollout.generation.collect_rollout`, started when asked for or ``lookahead`` steps ahead."""

    def __init__(self, *args: Any, lookahead: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.lookahead = lookahead
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._before_next: Callable[[], Any] | None = None

    def defer(self, swap: Callable[[], Any]) -> None:
        """Run ``swap`` (a staged weight update's swap) once the rollout in flight is done and before the next one
        starts: under one_step the weights are sent while that rollout samples, and no rollout mixes versions."""
        self._before_next = swap

    def _swap_pending(self) -> None:
        swap, self._before_next = self._before_next, None
        if swap is not None:
            swap()

    def start(self, step: int) -> None:
        pass

    def _submit(self, step: int) -> None:
        s = self.settings
        taken: list[int] = []

        def next_prompts(n: int) -> list[Sample]:
            prompts = self.feed.take(n)
            taken.extend(p.metadata[HANDOUT_KEY] for p in prompts)
            return prompts

        async def produce() -> Rollout:
            started = time.perf_counter()
            samples, metrics, outcomes = await collect_rollout(
                self.ctx,
                next_prompts,
                self.hub,
                rollout_batch_size=s.rollout_batch_size,
                n_samples=s.n_samples,
                params=s.params,
                over_sampling_batch_size=s.over_sampling_batch_size,
                filter_fn=self.filter_fn,
                custom_generate=self.custom_generate,
                rollout_id=step,
                sample_filter=self.sample_filter,
                all_samples_process=self.all_samples_process,
            )
            # The generation's own seconds: under one_step it overlaps training, and perf/rollout_wait_time does not
            # show it.
            metrics = {**metrics, "perf/rollout_time": time.perf_counter() - started}
            return Rollout(step, samples, metrics, handouts=taken, outcomes=outcomes)

        self._futures[step] = self.runner.submit(produce())

    def get(self, step: int) -> Rollout:
        if step not in self._futures:
            self._swap_pending()
            self._submit(step)
        rollout = self._futures.pop(step).result()
        ahead = step + self.lookahead
        if self.lookahead and ahead < self.settings.num_rollout and ahead not in self._futures:
            self._swap_pending()
            self._submit(ahead)
        rollout.metrics.update(staleness_metrics(rollout.samples, step=step))
        return rollout

    def pause(self) -> None:
        # Drained: a rollout started ahead finishes with the weights it started with, before they change. One that
        # failed reports its error when its step asks for it (get), so a failure always stops the job between steps.
        concurrent.futures.wait(list(self._futures.values()))

    def resume(self, version: int) -> None:
        pass

    def close(self) -> None:
        for future in self._futures.values():
            future.cancel()
        self._futures.clear()
        self._before_next = None


@dataclass
class _Slot:
    """One admitted group in the fully-async buffer: its samples, admission version, and what became of it."""

    seq: int
    group: list[Sample]
    version: int
    done: bool = False
    outcome: str | None = None  # None: to train; else one of OUTCOMES
    reason: str | None = None


class StreamingSource(_Source):
    """``fully_async``: groups admitted across steps under ``--max-staleness``, trained in admission order."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._slots: collections.OrderedDict[int, _Slot] = collections.OrderedDict()
        self._next_seq = 0
        self._consumed = 0  # live groups consumed (trained) since start, counted from the start step
        self._base_step = 0
        self._version = 0
        self._paused = False
        self._busy = 0  # chunks generating right now
        self._producer: concurrent.futures.Future | None = None
        self._changed: asyncio.Condition | None = None
        self._tasks: set[asyncio.Task] = set()
        self._error: BaseException | None = None

    # -- producer (runs on the event loop) -------------------------------------------------------------------

    def start(self, step: int) -> None:
        self._base_step = step
        self._version = step

        async def init() -> None:
            self._changed = asyncio.Condition()

        self.runner.run(init())
        self._producer = self.runner.submit(self._produce())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _live(self) -> int:
        return sum(1 for slot in self._slots.values() if slot.outcome is None)

    def _allowance(self) -> int:
        """Groups that may be admitted now: a group admitted at version ``v`` must be trained by step
        ``v + max_staleness``, and groups are trained in admission order, ``rollout_batch_size`` per step."""
        s = self.settings
        bound = (self._version - self._base_step + s.max_staleness + 1) * s.rollout_batch_size
        return bound - (self._consumed + self._live())

    async def _produce(self) -> None:
        s = self.settings
        chunk = s.over_sampling_batch_size or s.rollout_batch_size
        try:
            while True:
                async with self._changed:
                    await self._changed.wait_for(lambda: not self._paused and self._allowance() > 0)
                    n = min(self._allowance(), chunk)
                    prompts = self.feed.take(n)
                    slots = []
                    for group in expand_groups(prompts, s.n_samples, first_group=self._next_seq):
                        slot = _Slot(self._next_seq, group, self._version)
                        self._slots[slot.seq] = slot
                        self._next_seq += 1
                        slots.append(slot)
                    self._busy += 1
                task = asyncio.ensure_future(self._run_chunk(slots))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            self._error = err
            await self._notify()

    async def _run_chunk(self, slots: list[_Slot]) -> None:
        s = self.settings
        try:
            groups = [slot.group for slot in slots]
            with _running(self.ctx):
                await _generate_groups(
                    self.ctx, groups, s.params, self.custom_generate, rollout_id=slots[0].version if slots else None
                )
                while s.partial_rollout and any(x.status == Sample.Status.ABORTED for g in groups for x in g):
                    # Cut off by a weight update: park until the new weights are in, then go on from where it stopped.
                    self._busy -= 1
                    await self._notify()
                    async with self._changed:
                        await self._changed.wait_for(lambda: not self._paused)
                        self._busy += 1
                    await self._continue(groups)
            whole, aborted = split_aborted(groups)
            unscored = [x for g in whole for x in g if x.reward is None]
            if unscored:
                await self.hub.score(unscored)
            passed, _ = filter_groups(self.filter_fn, self.ctx.args, whole)
            passed_ids = {id(g[0]) for g in passed}
            aborted_ids = {id(g) for g in aborted}
            for slot in slots:
                if id(slot.group) in aborted_ids:
                    slot.outcome = "aborted"
                elif id(slot.group[0]) not in passed_ids:
                    slot.outcome = "filtered"
                slot.done = True
        except BaseException as err:
            self._error = err
        finally:
            self._busy -= 1
            await self._notify()

    async def _continue(self, groups: list[list[Sample]]) -> None:
        """Generate the rest of every aborted sample with the current weights and join it to what it had."""
        s = self.settings
        cut = [x for g in groups for x in g if x.status == Sample.Status.ABORTED]
        by_budget: dict[int, list[Sample]] = collections.defaultdict(list)
        for x in cut:
            by_budget[s.params.max_new_tokens - x.response_length].append(x)
        for budget, samples in by_budget.items():
            if budget <= 0:
                for x in samples:
                    x.status = Sample.Status.TRUNCATED
                continue
            params = dataclasses.replace(s.params, max_new_tokens=budget)
            generations = await self.ctx.engines.generate([x.tokens for x in samples], params)
            for x, generation in zip(samples, generations, strict=True):
                old_len, old_lps, old_mask = x.response_length, x.rollout_log_probs or [], x.loss_mask or []
                old_nucleus = (x.rollout_top_p_token_ids, x.rollout_top_p_token_offsets)
                old_tokens = x.tokens[len(x.tokens) - old_len :] if old_len else []
                x.tokens = x.tokens[: len(x.tokens) - old_len]
                apply_generation(x, generation, self.ctx.tokenizer, skip_special_tokens=self.ctx.skip_special_tokens)
                new_tokens = x.tokens[len(x.tokens) - x.response_length :]
                x.tokens = x.tokens[: len(x.tokens) - x.response_length] + old_tokens + new_tokens
                keep_old = 0 if s.mask_offpolicy_in_partial_rollout else 1
                x.loss_mask = [m * keep_old for m in old_mask] + x.loss_mask
                x.rollout_log_probs = list(old_lps) + list(x.rollout_log_probs)
                if old_nucleus[1] is not None and x.rollout_top_p_token_offsets is not None:
                    x.rollout_top_p_token_ids, x.rollout_top_p_token_offsets = concat_nuclei(
                        old_nucleus, (x.rollout_top_p_token_ids, x.rollout_top_p_token_offsets)
                    )
                x.response_length = old_len + x.response_length
                x.response = self.ctx.tokenizer.decode(
                    x.tokens[len(x.tokens) - x.response_length :], skip_special_tokens=self.ctx.skip_special_tokens
                )

    # -- consumer (the loop's thread) ------------------------------------------------------------------------

    def get(self, step: int) -> Rollout:
        return self.runner.run(self._take(step))

    async def _take(self, step: int) -> Rollout:
        s = self.settings
        kept: list[list[Sample]] = []
        handouts: list[int] = []
        outcomes: dict[str, list[int]] = {name: [] for name in OUTCOMES}
        skipped = 0
        async with self._changed:
            while len(kept) < s.rollout_batch_size:
                await self._changed.wait_for(lambda: self._error is not None or self._head_done())
                if self._error is not None:
                    raise self._error
                slot = self._slots.popitem(last=False)[1]
                handouts.append(slot.group[0].metadata[HANDOUT_KEY])
                if slot.outcome is None:
                    kept.append(slot.group)
                    self._consumed += 1
                else:
                    outcomes[slot.outcome].append(slot.group[0].index)
                    skipped += 1
                    if skipped > MAX_SAMPLING_ROUNDS * s.rollout_batch_size:
                        raise JobError(
                            f"step {step}: "
                            + kept_too_few(
                                self.filter_fn,
                                kept=len(kept),
                                generated=len(kept) + skipped,
                                rounds=None,
                                need=s.rollout_batch_size,
                            )
                        )
            self._changed.notify_all()
        if self.sample_filter is not None:
            self.sample_filter(self.ctx.args, kept)
        samples = [x for g in kept for x in g]
        metrics: dict[str, float] = {
            "rollout/groups_dropped": len(outcomes["filtered"]),
            "rollout/groups_aborted": len(outcomes["aborted"]),
            "rollout/groups_in_flight": sum(1 for x in self._slots.values() if not x.done),
            "rollout/groups_buffered": sum(1 for x in self._slots.values() if x.done),
            **self.hub.pop_metrics(),
            **sample_metrics(samples, reward_key=self.hub.reward_key),
            **staleness_metrics(samples, step=step),
        }
        return Rollout(step, samples, metrics, handouts=handouts, outcomes=outcomes)

    def _head_done(self) -> bool:
        return bool(self._slots) and next(iter(self._slots.values())).done

    def pause(self) -> None:
        async def pause() -> None:
            async with self._changed:
                self._paused = True
            if self.settings.partial_rollout:
                await asyncio.to_thread(self.ctx.engines.abort)
            async with self._changed:
                await self._changed.wait_for(lambda: self._busy == 0 or self._error is not None)
            # An error is raised by the next get, so that a failure always stops the job between steps.

        self.runner.run(pause())

    def resume(self, version: int) -> None:
        async def resume() -> None:
            async with self._changed:
                self._version = version
                self._paused = False
                self._changed.notify_all()

        self.runner.run(resume())

    def close(self) -> None:
        if self._producer is not None:
            self._producer.cancel()


SCHEDULES: dict[str, Callable[..., RolloutSource]] = {
    "sync": lambda *a, **k: BatchSource(*a, lookahead=0, **k),
    "one_step": lambda *a, **k: BatchSource(*a, lookahead=1, **k),
    "fully_async": StreamingSource,
}
