"""runtime.rollout.rewards, .filters and runtime.hooks: custom rewards, failure counting, filters, hooks."""

import asyncio
import gc
import os
import pickle
import textwrap
import threading
import time

import psutil
import pytest
import torch
from math_verify import parse, verify

from runtime.config import RewardConfig
from runtime.demo import task
from runtime.hooks import HookError, HookFailure, load_function
from runtime.rollout.filters import DynamicFilterOutput, check_reward_nonzero_std, filter_groups, load_filter
from runtime.rollout.rewards import BUILTIN_ISOLATION, RM_NAMES, RewardHub, is_batched, reward_isolation
from runtime.rollout.sample import Sample


def _samples(pairs):
    return [Sample(index=i, response=response, label=label) for i, (response, label) in enumerate(pairs)]


def _hook(tmp_path, name, source):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


def _score(hub, samples):
    return asyncio.run(hub.score(samples))


MATH_CASES = [
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{2/4}", "\\frac{1}{2}", 1.0),
    ("The final answer is $12$", "12", 1.0),
    ("\\boxed{3}", "2", 0.0),
    ("I think it is 2", "2", 0.0),  # no boxed answer: a stray number does not score
    ("\\boxed{x+1}", "1+x", 1.0),
]


def test_math_reward_right_and_wrong():
    hub = RewardHub(RewardConfig(rm_type="math"))
    samples = _samples([(r, label) for r, label, _ in MATH_CASES])
    rewards = _score(hub, samples)
    assert rewards == [expected for _, _, expected in MATH_CASES]
    assert [s.reward for s in samples] == rewards
    # Where an answer is boxed, the hub agrees with math-verify called directly (a bare label read as LaTeX).
    for (response, label, _), reward in zip(MATH_CASES, rewards, strict=True):
        if "boxed" in response:
            assert reward == float(verify(parse(f"${label}$"), parse(response)))
    assert hub.pop_metrics()["reward/errors"] == 0


def test_math_reward_unparseable_label_counts_an_error():
    hub = RewardHub(RewardConfig(rm_type="math"))
    pairs = [("\\boxed{1}", "  "), ("\\boxed{1}", None), ("\\boxed{1}", "1")]
    assert _score(hub, _samples(pairs)) == [0.0, 0.0, 1.0]
    metrics = hub.pop_metrics()
    assert metrics["reward/errors"] == 2 and metrics["reward/num_scored"] == 3


def test_exact_match():
    hub = RewardHub(RewardConfig(rm_type="exact_match"))
    samples = _samples([(" 42 \n", "42"), ("42.", "42"), ("abc", " abc"), ("x", None)])
    assert _score(hub, samples) == [1.0, 0.0, 1.0, 0.0]
    assert hub.pop_metrics()["reward/errors"] == 1  # the sample without a label


def test_builtin_is_the_task_reward():
    hub = RewardHub(RewardConfig(rm_type="builtin"))
    pairs = [("123", "123"), ("129", "123"), ("", "45"), ("9", "9")]
    assert _score(hub, _samples(pairs)) == [task.score(r, label) for r, label in pairs]


def test_custom_sync_per_sample_gets_args(tmp_path):
    path = _hook(
        tmp_path,
        "sync_rm",
        """
        def reward(args, sample, **kwargs):
            return args["scale"] * len(sample.response)
        """,
    )
    hub = RewardHub(RewardConfig(custom_rm_path=f"{path}:reward"), args={"scale": 0.5})
    assert not hub.batched and not hub.is_async
    assert _score(hub, _samples([("ab", None), ("abcd", None)])) == [1.0, 2.0]


def test_custom_async_per_sample_runs_concurrently(tmp_path):
    path = _hook(
        tmp_path,
        "async_rm",
        """
        import asyncio

        async def reward(args, sample, **kwargs):
            await asyncio.sleep(0.2)
            return {"score": float(sample.response == sample.label), "detail": sample.index}
        """,
    )
    hub = RewardHub(RewardConfig(custom_rm_path=f"{path}:reward"))
    assert hub.is_async and not hub.batched
    _score(hub, _samples([("a", "a")]))  # the workers fork on the first call: not what is timed below
    samples = _samples([("a", "a"), ("b", "c")] * 4)
    start = time.perf_counter()
    assert _score(hub, samples) == [1.0, 0.0] * 4
    assert time.perf_counter() - start < 0.2 * len(samples) / 2  # gathered, not one after another
    assert samples[3].reward == {"score": 0.0, "detail": 3}


def test_custom_batched_sync_and_async(tmp_path):
    path = _hook(
        tmp_path,
        "batched_rm",
        """
        from runtime.rollout.sample import Sample

        def by_name(args, samples, **kwargs):
            args.write(len(samples))
            mean = sum(len(s.response) for s in samples) / len(samples)
            return [len(s.response) - mean for s in samples]

        async def by_annotation(args, group: list[Sample], **kwargs):
            args.write(len(group))
            return [float(i) for i in range(len(group))]

        def wrong_length(args, samples):
            return [1.0]
        """,
    )
    log = _CallLog(tmp_path / "calls")  # the calls run in worker processes: they leave their trace in a file
    hub = RewardHub(RewardConfig(custom_rm_path=f"{path}:by_name"), args=log)
    assert hub.batched and not hub.is_async
    assert _score(hub, _samples([("a", None), ("abc", None)])) == [-1.0, 1.0]
    hub = RewardHub(RewardConfig(custom_rm_path=f"{path}:by_annotation"), args=log)
    assert hub.batched and hub.is_async
    assert _score(hub, _samples([("a", None)] * 3)) == [0.0, 1.0, 2.0]
    assert log.read() == [2, 3]  # one call per batch
    hub = RewardHub(RewardConfig(custom_rm_path=f"{path}:wrong_length"))
    assert _score(hub, _samples([("a", None)] * 3)) == [0.0, 0.0, 0.0]
    assert hub.pop_metrics()["reward/errors"] == 3


class _CallLog:
    """``args`` of a reward that notes each call's number in a file, from whichever process runs it."""

    def __init__(self, path):
        self.path = path

    def write(self, value):
        with open(self.path, "a") as fh:
            fh.write(f"{value}\n")

    def read(self):
        return [int(line) for line in self.path.read_text().split()] if self.path.exists() else []


def test_raising_reward_gives_zero_and_counts(tmp_path):
    path = _hook(
        tmp_path,
        "raising_rm",
        """
        def reward(args, sample):
            if sample.index % 2:
                raise RuntimeError("reward server exploded")
            return 1.0

        def own_timeout(args, sample):
            raise TimeoutError("the function's own timeout, not the hub's")

        def not_a_number(args, sample):
            return [float("nan"), "high", None][sample.index]
        """,
    )
    hub = RewardHub(RewardConfig(custom_rm_path=f"{path}:reward"))
    samples = _samples([("x", None)] * 5)
    assert _score(hub, samples) == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert samples[1].reward == 0.0
    metrics = hub.pop_metrics()
    assert (metrics["reward/errors"], metrics["reward/timeouts"], metrics["reward/num_scored"]) == (2, 0, 5)
    assert hub.pop_metrics()["reward/errors"] == 0  # popped counters restart

    hub = RewardHub(RewardConfig(custom_rm_path=f"{path}:own_timeout"))
    assert _score(hub, _samples([("x", None)])) == [0.0]
    assert hub.pop_metrics()["reward/errors"] == 1
    hub = RewardHub(RewardConfig(custom_rm_path=f"{path}:not_a_number"))
    assert _score(hub, _samples([("x", None)] * 3)) == [0.0, 0.0, 0.0]
    assert hub.pop_metrics()["reward/errors"] == 3


def test_timing_out_reward_gives_zero_and_counts(tmp_path):
    path = _hook(
        tmp_path,
        "slow_rm",
        """
        import asyncio
        import time

        async def slow_async(args, sample):
            await asyncio.sleep(30 if sample.index == 0 else 0)
            return 1.0

        def slow_sync(args, sample):
            time.sleep(30 if sample.index == 0 else 0)
            return 1.0

        async def slow_batch(args, samples):
            await asyncio.sleep(30)
            return [1.0] * len(samples)
        """,
    )
    for name in ("slow_async", "slow_sync"):
        hub = RewardHub(RewardConfig(custom_rm_path=f"{path}:{name}", reward_timeout=0.2))
        start = time.perf_counter()
        assert _score(hub, _samples([("x", None)] * 3)) == [0.0, 1.0, 1.0]
        # 0.2 s, then the kill (pebble looks every 0.1 s) and the first call's forks, with slack for a loaded
        # machine: far from the 30 s the call would take.
        assert time.perf_counter() - start < 3.0
        metrics = hub.pop_metrics()
        assert (metrics["reward/timeouts"], metrics["reward/errors"]) == (1, 0), name
        hub.close()
    hub = RewardHub(RewardConfig(custom_rm_path=f"{path}:slow_batch", reward_timeout=0.1))
    assert _score(hub, _samples([("x", None)] * 4)) == [0.0] * 4
    assert hub.pop_metrics()["reward/timeouts"] == 4


def test_hub_pickles_with_a_file_hook(tmp_path):
    path = _hook(tmp_path, "pick_rm", "def reward(args, sample):\n    return 0.25\n")
    hub = RewardHub(RewardConfig(custom_rm_path=f"{path}:reward"))
    _score(hub, _samples([("x", None)]))
    clone = pickle.loads(pickle.dumps(hub))
    assert _score(clone, _samples([("x", None)])) == [0.25]


def test_reward_function_signature_checks():
    def one_arg(args):
        return 0.0

    with pytest.raises(TypeError, match="must take \\(args, sample\\)"):
        is_batched(one_arg)

    def flagged(args, x):
        return [0.0]

    flagged.batched = True
    assert is_batched(flagged)
    with pytest.raises(TypeError, match="list of runtime.rollout.sample.Sample"):
        _score(RewardHub(RewardConfig(rm_type="exact_match")), ["not a sample"])


# Filters


def _group(rewards):
    return [Sample(index=i, reward=r) for i, r in enumerate(rewards)]


@pytest.mark.parametrize(
    "rewards",
    [[1.0, 1.0, 1.0], [0.0, 0.0], [0.5], [1.0, 0.0, 1.0], [0.2, 0.2, 0.2 + 1e-3], [0.3, 0.3, 0.3, 0.3], [0.0, 1.5e-6]],
)
def test_check_reward_nonzero_std_matches_std(rewards):
    out = check_reward_nonzero_std(None, _group(rewards))
    assert isinstance(out, DynamicFilterOutput)
    # slime's filter: torch.std (unbiased) in float64 above 1e-6; [0, 1.5e-6] is kept (its population std is below).
    unbiased = torch.tensor(rewards, dtype=torch.float64).std().item() if len(rewards) > 1 else 0.0
    assert out.keep == (len(rewards) > 1 and unbiased > 1e-6)
    assert (out.reason is None) == out.keep
    if not out.keep:
        assert out.reason == f"zero_std_{round(rewards[0], 1)}"


def test_filter_reads_dict_rewards_and_rejects_unscored():
    assert check_reward_nonzero_std(None, [Sample(reward={"score": 1.0}), Sample(reward={"score": 0.0})]).keep
    with pytest.raises(ValueError, match="no reward yet"):
        check_reward_nonzero_std(None, [Sample(reward=None)])


def test_load_filter_builtin_and_custom(tmp_path):
    builtin = load_filter("runtime.rollout.filters.check_reward_nonzero_std")
    assert builtin(None, _group([0.0, 1.0])).keep
    assert not load_filter("runtime.rollout.filters:check_reward_nonzero_std")(None, _group([1.0, 1.0])).keep
    path = _hook(
        tmp_path,
        "filters_hook",
        """
        import torch
        from types import SimpleNamespace

        def slime_style(args, samples, **kwargs):
            rewards = torch.tensor([s.reward for s in samples])
            keep = rewards.std() > 1e-6
            return SimpleNamespace(keep=keep, reason=None if keep else "flat")

        def broken(args, samples):
            return True
        """,
    )
    slime_style = load_filter(f"{path}:slime_style")
    assert slime_style(None, _group([0.0, 1.0])) == DynamicFilterOutput(keep=True, reason=None)
    assert slime_style(None, _group([1.0, 1.0])) == DynamicFilterOutput(keep=False, reason="flat")
    with pytest.raises(
        HookFailure,
        match=r"--dynamic-sampling-filter-path .*:broken: returned bool True, expected "
        r"DynamicFilterOutput\(keep: bool, reason\) \(.*filters_hook.py:10\)",
    ):
        load_filter(f"{path}:broken")(None, _group([0.0]))
    assert torch.tensor(True).item() is True


def test_filter_groups_keeps_order_and_counts_reasons():
    groups = [_group([1.0, 1.0]), _group([0.0, 1.0]), _group([0.0, 0.0]), _group([0.5, 0.0]), _group([1.0, 1.0])]
    kept, dropped = filter_groups(check_reward_nonzero_std, None, groups)
    assert kept == [groups[1], groups[3]]
    assert dropped == {"zero_std_1.0": 2, "zero_std_0.0": 1}
    kept, dropped = filter_groups(None, None, groups)
    assert kept == groups and not dropped


# Hooks


def test_load_function_spellings_and_errors(tmp_path):
    assert load_function("runtime.demo.task:reward") is task.reward
    assert load_function("runtime.demo.task.reward") is task.reward
    path = _hook(tmp_path, "plain", "VALUE = 3\n\ndef fn():\n    return VALUE\n")
    fn = load_function(f"{path}:fn")
    assert fn() == 3 and load_function(f"{path}:fn") is fn  # one module per file
    with pytest.raises(HookError, match="plain.py has no function 'missing'"):
        load_function(f"{path}:missing")
    with pytest.raises(HookError, match="not a callable"):
        load_function(f"{path}:VALUE")
    with pytest.raises(HookError, match="does not exist"):
        load_function(f"{tmp_path}/nope.py:fn")
    with pytest.raises(HookError, match="no module named 'no_such_pkg_q'"):
        load_function("no_such_pkg_q.mod:fn")
    for bad in ("", "justaname", "mod:", "mod:not-an-identifier"):
        with pytest.raises(HookError):
            load_function(bad)
    broken = _hook(tmp_path, "broken_import", "import no_such_dependency_q\n\ndef fn():\n    pass\n")
    with pytest.raises(
        HookError,
        match=r"importing it raised ModuleNotFoundError: .*no_such_dependency_q.* \(.*"
        r"broken_import.py:1\)",
    ):
        load_function(f"{broken}:fn")  # a hook's own import error names its file and line


def test_sync_reward_timeout_counts_only_running_time(tmp_path):
    # 40 calls of 0.3 s on 8 threads take 1.5 s in all; none runs for 1 s. Timing the wait for a free thread too
    # (the pool's queue) timed out 16 of them.
    path = _hook(
        tmp_path,
        "steady",
        """
        import time

        def steady(args, sample):
            time.sleep(0.3)
            return 1.0
        """,
    )
    hub = RewardHub(RewardConfig(custom_rm_path=f"{path}:steady", reward_timeout=1.0), max_workers=8)
    start = time.perf_counter()
    assert _score(hub, _samples([("x", None)] * 40)) == [1.0] * 40
    wall = time.perf_counter() - start
    metrics = hub.pop_metrics()
    assert (metrics["reward/timeouts"], metrics["reward/errors"]) == (0, 0)
    assert 1.5 <= wall < 3.0  # at most 8 at a time: 5 waves of 0.3 s
    hub.close()


def test_a_reward_that_hangs_now_and_then_loses_only_the_calls_that_hang(tmp_path):
    path = _hook(
        tmp_path,
        "stuck",
        """
        import time

        def stuck(args, sample):
            time.sleep(2.0 if sample.index == 0 else 0.05)
            return 1.0
        """,
    )
    hub = RewardHub(RewardConfig(custom_rm_path=f"{path}:stuck", reward_timeout=0.3), max_workers=2)
    # The stuck call keeps its slot until it returns; the other slot scores the rest, which keep finishing, so the
    # shared deadline (no call finished for --reward-timeout) never passes.
    assert _score(hub, _samples([("x", None)] * 6)) == [0.0] + [1.0] * 5
    assert hub.pop_metrics()["reward/timeouts"] == 1
    with pytest.raises(ValueError, match="max_workers must be a positive int"):
        RewardHub(RewardConfig(custom_rm_path=f"{path}:stuck"), max_workers=0)


def _score_or_fail(hub, samples, *, limit_s=20.0):
    # A regression here used to end the event loop (or hang the job): fail the test instead of the session.
    try:
        return asyncio.run(asyncio.wait_for(hub.score(samples), limit_s))
    except BaseException as err:  # noqa: BLE001  (SystemExit / KeyboardInterrupt escaping is the bug)
        pytest.fail(f"score() raised {type(err).__name__}: {err!r}")


@pytest.mark.parametrize(
    "body",
    [
        "sys.exit(3)",
        "raise KeyboardInterrupt",
        "raise SystemExit('bye')",
        "raise GeneratorExit",
    ],
)
@pytest.mark.parametrize("kind", ["def", "async def"])
def test_a_reward_that_raises_a_base_exception_is_a_counted_error(tmp_path, body, kind):
    path = _hook(
        tmp_path,
        "exits",
        f"""
        import sys

        {kind} exits(args, sample):
            if sample.index == 1:
                {body}
            return 1.0
        """,
    )
    hub = RewardHub(RewardConfig(custom_rm_path=f"{path}:exits", reward_timeout=5.0))
    assert _score_or_fail(hub, _samples([("x", None)] * 3)) == [1.0, 0.0, 1.0]
    metrics = hub.pop_metrics()
    assert (metrics["reward/errors"], metrics["reward/timeouts"]) == (1, 0)


def _running(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_hung_reward_is_killed_costs_one_timeout_a_step_and_leaves_no_process_or_thread(tmp_path):
    hung, flag = tmp_path / "hung", tmp_path / "hang"
    hung.mkdir()
    flag.touch()
    path = _hook(
        tmp_path,
        "sleeps",
        f"""
        import os
        import time
        from pathlib import Path

        def sleeps(args, sample):
            if Path({str(flag)!r}).exists():
                Path({str(hung)!r}, str(os.getpid())).touch()
                time.sleep(3600)
            return 1.0
        """,
    )
    timeout, workers, n = 0.5, 8, 160
    threads_before = set(threading.enumerate())
    me = psutil.Process()
    children_before = {c.pid for c in me.children(recursive=True)}
    hub = RewardHub(RewardConfig(custom_rm_path=f"{path}:sleeps", reward_timeout=timeout), max_workers=workers)
    assert hub.isolation == "process"
    seen = set()
    for _ in range(2):  # two steps
        start = time.perf_counter()
        assert _score_or_fail(hub, _samples([("x", None)] * n)) == [0.0] * n
        wall = time.perf_counter() - start
        # One timeout a step (the wave of 8 calls that started, then the rest not started), then up to 0.1 s until
        # pebble looks, the 8 kills one after another and the first step's forks, with slack for a loaded 2-core
        # machine (3 s measured at a load of 12); a timeout per wave of 8 would take n / 8 x 0.5 = 10 s.
        assert wall < 2 * timeout + 2.5, wall
        assert hub.pop_metrics()["reward/timeouts"] == n
        pids = {int(p.name) for p in hung.iterdir()} - seen
        # The 8 calls of the step ran in worker processes, and each was killed before score() returned.
        assert len(pids) == workers and os.getpid() not in pids
        assert not [pid for pid in pids if _running(pid)]
        seen |= pids
    flag.unlink()
    assert _score_or_fail(hub, _samples([("x", None)] * n)) == [1.0] * n  # fresh workers score again
    hub.close()
    assert not [c.pid for c in me.children(recursive=True) if c.pid not in children_before and _running(c.pid)]
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(threading.enumerate()) - threads_before


def test_a_hung_reward_in_threads_costs_one_timeout_a_step_and_its_threads_do_not_pile_up(tmp_path):
    path = _hook(
        tmp_path,
        "hangs",
        """
        import threading

        release = threading.Event()

        def hangs(args, sample):
            release.wait()
            return 1.0

        hangs.isolation = "thread"  # the hub's own process: the test releases the event there
        """,
    )
    release = load_function(f"{path}:hangs").__globals__["release"]
    timeout, workers, n = 0.4, 8, 40
    hub = RewardHub(RewardConfig(custom_rm_path=f"{path}:hangs", reward_timeout=timeout), max_workers=workers)
    assert hub.isolation == "thread"

    def reward_threads():  # the hub's own (other tests' hubs may still be winding down beside them)
        return sum(t.name == "reward" for t in threading.enumerate())

    before = reward_threads()
    try:
        for _ in range(2):  # two steps
            start = time.perf_counter()
            assert _score_or_fail(hub, _samples([("x", None)] * n)) == [0.0] * n
            wall = time.perf_counter() - start
            # One timeout a step (the wave of 8 calls that started, then the rest not started), with slack for a
            # loaded 2-core machine; a timeout per wave of 8 would take n / 8 x 0.4 = 2.0 s.
            assert wall < 3 * timeout, wall
            assert hub.pop_metrics()["reward/timeouts"] == n
            # At most max_workers threads hang (not one per timed-out call: 40, then 80).
            assert reward_threads() - before <= workers
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while reward_threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reward_threads() == before
    # The hung threads gave their slots back as they returned: every call runs again.
    assert _score_or_fail(hub, _samples([("x", None)] * n)) == [1.0] * n


def test_a_reward_in_a_worker_sets_fields_on_the_sample_and_a_dying_worker_is_a_counted_error(tmp_path):
    path = _hook(
        tmp_path,
        "worker_rm",
        """
        import os

        def tags(args, sample):
            sample.metadata["scored_by"] = os.getpid()
            return 1.0

        def dies(args, sample):
            if sample.index == 1:
                os._exit(7)
            return 1.0
        """,
    )
    hub = RewardHub(RewardConfig(custom_rm_path=f"{path}:tags"))
    samples = _samples([("x", None)] * 3)
    assert _score(hub, samples) == [1.0] * 3
    # What the function set on its copy of the sample came back, from another process.
    pids = {s.metadata["scored_by"] for s in samples}
    assert pids and os.getpid() not in pids
    hub.close()
    children_before = {c.pid for c in psutil.Process().children()}
    hub = RewardHub(RewardConfig(custom_rm_path=f"{path}:dies", reward_timeout=5.0))
    assert _score_or_fail(hub, _samples([("x", None)] * 3)) == [1.0, 0.0, 1.0]
    metrics = hub.pop_metrics()
    assert (metrics["reward/errors"], metrics["reward/timeouts"]) == (1, 0)
    assert _score_or_fail(hub, _samples([("x", None)] * 3))[0] == 1.0  # a fresh worker replaced the dead one
    # A hub dropped without close() stops its workers as it is collected.
    workers = [c for c in psutil.Process().children() if c.pid not in children_before and _running(c.pid)]
    assert workers
    del hub
    gc.collect()
    deadline = time.monotonic() + 10
    while [c for c in workers if _running(c.pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [c.pid for c in workers if _running(c.pid)]


def test_where_each_reward_runs():
    # Every built-in type has its place; math-verify's run in killable workers, the string rules in threads.
    assert set(BUILTIN_ISOLATION) == set(RM_NAMES)
    places = {name: RewardHub(RewardConfig(rm_type=name, rm_url="http://127.0.0.1:1")).isolation for name in RM_NAMES}
    assert places == BUILTIN_ISOLATION
    assert RewardHub(RewardConfig(rm_type="boxed_math")).isolation == "process"
    assert RewardHub(RewardConfig(custom_rm_path="runtime.demo.task:reward")).isolation == "process"

    def in_threads(args, sample):
        return 1.0

    in_threads.isolation = "threads"
    with pytest.raises(ValueError, match=r"isolation must be one of \('process', 'thread'\), got 'threads'"):
        reward_isolation(in_threads)
