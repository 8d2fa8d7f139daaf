"""runtime.rollout.source: the three schedules, staleness by admission, partial rollout, and the prompt feed's books.

The engines are an in-process fake that samples token by token on the event loop, tags each generation with the
weight version it holds, and honours abort like the real engines (the partial response comes back with
``finish_reason="abort"``); everything else (collect_rollout, rewards, filters, the event-loop thread) is real.
"""

import asyncio
import inspect
import random
import threading
from types import SimpleNamespace

import pytest

from runtime.config import RewardConfig
from runtime.engines.base import Generation, SamplingParams
from runtime.rollout import RolloutContext
from runtime.rollout.filters import DynamicFilterOutput
from runtime.rollout.rewards import RewardHub
from runtime.rollout.sample import Sample
from runtime.rollout.source import (
    HANDOUT_KEY,
    SCHEDULES,
    EventLoopThread,
    PromptFeed,
    RolloutSettings,
    RolloutSource,
    StreamingSource,
)


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class _Dataset:
    """Prompts 0..n-1 in order, epoch after epoch; ``state_dict`` is the position."""

    def __init__(self, n=1000):
        self.n, self.pos = n, 0

    def next_batch(self, k):
        out = []
        for _ in range(k):
            i = self.pos % self.n
            self.pos += 1
            out.append(Sample(index=i, prompt=str(i), tokens=[100 + i], label="x" if i % 3 else "y", metadata={}))
        return out

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


class _Engines:
    """Samples ``max_new_tokens`` tokens one per loop tick (``delay`` seconds each, random per call when jittered);
    log-prob of token ``t`` is ``-t / 100``; ``abort()`` (from any thread) cuts the running calls short."""

    def __init__(self, *, delay=0.0, jitter=False, seed=0):
        self.version = 0
        self.delay, self.jitter, self.rng = delay, jitter, random.Random(seed)
        self._abort_epoch = 0
        self.calls = 0

    def rewind(self):
        pass

    def abort(self):
        self._abort_epoch += 1

    async def generate(self, prompts, params):
        epoch, version = self._abort_epoch, self.version
        self.calls += 1
        delay = self.delay * (self.rng.random() * 2 if self.jitter else 1)
        out = [[] for _ in prompts]
        reason = "length"
        for _ in range(params.max_new_tokens):
            if self._abort_epoch != epoch:
                reason = "abort"
                break
            await asyncio.sleep(delay)
            for i, p in enumerate(prompts):
                out[i].append(1 + (p[-1] + len(out[i])) % 7)
        return [Generation(t, [-x / 100 for x in t], reason, weight_version=version) for t in out]


def _reward(args, sample, **kwargs):
    return float(sum(sample.tokens) % 2)


@pytest.fixture
def runner():
    r = EventLoopThread()
    yield r
    r.close()


def _source(runner, schedule, engines, *, filter_fn=None, dataset=None, **settings):
    s = {"rollout_batch_size": 2, "n_samples": 2, "params": SamplingParams(4), "num_rollout": 6, **settings}
    hub = RewardHub(RewardConfig(custom_rm_path="test_rollout_source:_reward"))
    ctx = RolloutContext(engines=engines, tokenizer=_Tokenizer(), args=SimpleNamespace())
    feed = PromptFeed(dataset or _Dataset())
    return SCHEDULES[schedule](runner, feed, ctx, hub, RolloutSettings(**s), filter_fn=filter_fn), feed


def _train(source, engines, steps, *, start=0, interval=1, on_step=None):
    """The loop's calls, as ``runtime.loop.run`` makes them: get, (train), pause/push/resume, commit."""
    rollouts = []
    source.start(start)
    for step in range(start, start + steps):
        rollout = source.get(step)
        rollouts.append(rollout)
        if on_step is not None:
            on_step(step, rollout)
        if (step + 1) % interval == 0:
            source.pause()
            engines.version = step + 1
            source.resume(step + 1)
        source.commit(rollout)
    source.close()
    return rollouts


def test_every_schedule_conforms_to_the_protocol(runner):
    methods = {name for name, _ in inspect.getmembers(RolloutSource, inspect.isfunction) if not name.startswith("_")}
    assert methods == {"start", "get", "pause", "resume", "commit", "close"}
    for schedule in SCHEDULES:
        dataset = _Dataset()
        source, feed = _source(runner, schedule, _Engines(), dataset=dataset)
        assert isinstance(source, RolloutSource)
        rollouts = _train(source, source.ctx.engines, 3)
        assert [r.step for r in rollouts] == [0, 1, 2]
        for r in rollouts:
            assert len(r.samples) == 4 and all(s.response_length == 4 and s.reward is not None for s in r.samples)
        trained = [i for r in rollouts for i in r.trained_indices]
        assert trained == list(range(6)), schedule  # no filter: prompts trained in the order handed out
        # What is handed out but not trained stays on the books: nothing (sync), the rollout started ahead (one
        # step: step 3's two prompts), or every prompt the data gave beyond the six trained (fully async, whose
        # admission runs on while the trainer trains: a count only the data's own position tells).
        drawn_ahead = dataset.pos - len(trained)
        ahead = {"sync": 0, "one_step": 2, "fully_async": drawn_ahead}[schedule]
        assert drawn_ahead == ahead and feed.num_outstanding == ahead, (schedule, drawn_ahead, feed.num_outstanding)


def test_sync_samples_on_policy_and_one_step_exactly_one_version_behind(runner):
    for schedule, expected in (("sync", [0] * 5), ("one_step", [0, 1, 1, 1, 1])):
        engines = _Engines()
        source, _ = _source(runner, schedule, engines)
        rollouts = _train(source, engines, 5)
        lags = [r.metrics["rollout/weight_version_lag_max"] for r in rollouts]
        assert lags == expected, schedule
        for r in rollouts:
            assert r.metrics["rollout/weight_version_lag_mean"] == r.metrics["rollout/weight_version_lag_max"]


@pytest.mark.parametrize(("max_staleness", "interval"), [(0, 1), (1, 1), (2, 1), (2, 3)])
def test_fully_async_never_exceeds_max_staleness(runner, max_staleness, interval):
    engines = _Engines(delay=0.001, jitter=True, seed=max_staleness)

    def drop_some(args, group, **kwargs):
        keep = group[0].index % 5 != 0
        return DynamicFilterOutput(keep=keep, reason=None if keep else "fifth")

    source, _ = _source(runner, "fully_async", engines, filter_fn=drop_some, max_staleness=max_staleness)
    seen = []

    def slow_trainer(step, rollout):
        seen.append(max(step - int(v) for s in rollout.samples for v in s.weight_versions))
        # Training takes time, so the producer runs ahead as far as admission lets it.
        threading.Event().wait(0.01)

    rollouts = _train(source, engines, 8, interval=interval, on_step=slow_trainer)
    assert max(seen) <= max_staleness
    assert max(seen) == max_staleness or max_staleness > interval  # the bound is reached, not just respected
    filtered = [i for r in rollouts for i in r.outcomes["filtered"]]
    assert filtered and all(i % 5 == 0 for i in filtered)
    assert all(i % 5 for r in rollouts for i in r.trained_indices)


@pytest.mark.parametrize("mask_offpolicy", [False, True])
def test_partial_rollout_resumes_cut_groups_and_joins_their_tokens(runner, mask_offpolicy):
    engines = _Engines(delay=0.02)
    source, _ = _source(
        runner,
        "fully_async",
        engines,
        params=SamplingParams(10),
        partial_rollout=True,
        mask_offpolicy_in_partial_rollout=mask_offpolicy,
        max_staleness=1,
    )
    assert isinstance(source, StreamingSource)
    rollouts = _train(source, engines, 4)
    joined = [s for r in rollouts for s in r.samples if len(s.weight_versions) > 1]
    assert joined, "no generation was cut off and resumed"
    for s in joined:
        assert s.response_length == 10 and len(s.rollout_log_probs) == 10 and len(s.loss_mask) == 10
        # The tokens join up: prompt, the part sampled before the update, then the rest.
        response = s.tokens[-10:]
        assert s.tokens[:-10] == [100 + s.index]
        assert s.rollout_log_probs == [-t / 100 for t in response]
        versions = [int(v) for v in s.weight_versions]
        assert versions == sorted(versions) and versions[0] < versions[-1]
        first = s.loss_mask.index(1) if 1 in s.loss_mask else 10
        assert (first > 0) == mask_offpolicy
        assert s.loss_mask[first:] == [1] * (10 - first)


def test_feed_hands_outstanding_prompts_out_again_first_after_a_resume():
    feed = PromptFeed(_Dataset())
    a = feed.take(3)
    b = feed.take(2)
    feed.commit([p.metadata[HANDOUT_KEY] for p in a[:2]])
    state = feed.state_dict()
    assert [p.index for p in state["outstanding"]] == [2, 3, 4]
    resumed = PromptFeed(_Dataset())
    resumed.load_state_dict(state)
    again = resumed.take(4)
    assert [p.index for p in again] == [2, 3, 4, 5]
    assert [p.metadata[HANDOUT_KEY] for p in again] == [2, 3, 4, 5]
    assert b[0].metadata[HANDOUT_KEY] == 3
