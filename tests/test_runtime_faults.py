"""Bad input and hook errors, through the CLI (``runtime.cli.main``) where the user meets them.

Errors found before anything starts exit 2 with one ``rlcore-run: ...`` line naming the flag or file (and line);
errors of a running job exit 1 with one line, after the last completed step is saved when ``--save`` is set. The
jobs that start run in-process on one Ray session for the module (``num_cpus=2``), with the built-in tiny model.
"""

import asyncio
import errno
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from runtime.cli import EXIT_BAD_INPUT, EXIT_JOB_STOPPED, main
from runtime.cluster import checkpoint, loopback
from runtime.config import DataConfig, RewardConfig, from_dict
from runtime.engines import SamplingParams
from runtime.errors import JobError
from runtime.faults import check_reward_errors
from runtime.hooks import HookFailure, resolve_hook
from runtime.logger import LEDGER_FILE, METRICS_FILE, read_metrics, repair_rows
from runtime.rollout import RolloutContext, collect_rollout
from runtime.rollout.data import DataError, PromptDataset
from runtime.rollout.filters import load_filter
from runtime.rollout.rewards import RewardHub, reward_error_rate
from runtime.rollout.sample import Sample

# The built-in job, small: 4 prompts x 4 samples a step, responses of up to 5 tokens.
SMALL = [
    "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
    "--micro-batch-size", "4", "--rollout-max-response-len", "5", "--no-use-tensorboard",
]  # fmt: skip


def _hook(tmp_path, name, source):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source).lstrip())
    return str(path)


def _err_lines(capsys):
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.out, [line for line in captured.err.splitlines() if line.startswith("rlcore-run:")]


def _prompts(tmp_path, lines: list[bytes]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _data_job(tmp_path, prompts, *extra):
    return ["--prompt-data", str(prompts), "--rm-type", "exact_match", "--rollout-max-response-len", "4",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
            "--actor-num-gpus-per-node", "1", "--input-key", "prompt", "--label-key", "label",
            "--output-dir", str(tmp_path / "out"), *extra]  # fmt: skip


# ---------------------------------------------------------------- bad rows: bytes not UTF-8, prompts over the context


def test_undecodable_bytes_are_a_bad_row_with_file_and_line(tmp_path, capsys):
    good = json.dumps({"prompt": "c12=", "label": "12"}).encode()
    prompts = _prompts(tmp_path, [b"\xef\xbb\xbf" + good, b'{"prompt": "c\xff3=", "label": "3"}', good])
    assert main(_data_job(tmp_path, prompts)) == EXIT_BAD_INPUT
    _, err = _err_lines(capsys)
    assert err == [
        f"rlcore-run: {prompts} line 2: not valid UTF-8 (byte 0xff at byte 14 of the line) (--on-bad-row skip skips "
        "such rows)"
    ]
    # --on-bad-row skip applies: the row is skipped and counted, the byte-order mark of line 1 is no bad byte.
    dataset = PromptDataset(
        prompts, None, DataConfig(on_bad_row="skip", input_key="prompt", label_key="label"), seed=0
    )
    assert len(dataset) == 2 and [line for line, _ in dataset.bad_rows] == [2]
    assert [s.prompt for s in dataset.next_batch(2)] == ["c12=", "c12="]


def test_a_prompt_longer_than_the_model_context_is_refused_or_dropped(tmp_path, capsys):
    long_prompt = "c" + "1" * 70 + "="  # the tiny model's context is 64 tokens
    rows = [json.dumps({"prompt": p, "label": "1"}).encode() for p in ("c12=", long_prompt, "c3=")]
    prompts = _prompts(tmp_path, rows)
    assert main(_data_job(tmp_path, prompts)) == EXIT_BAD_INPUT
    _, err = _err_lines(capsys)
    assert len(err) == 1 and f"{prompts} line 2: a prompt of " in err[0]
    assert "leaves no room for a response in the model's context of 64 tokens" in err[0]

    class CharTokenizer:
        def __call__(self, texts, add_special_tokens=True):
            return {"input_ids": [list(range(len(t))) for t in texts]}

    skip = PromptDataset(
        prompts,
        CharTokenizer(),
        DataConfig(on_bad_row="skip", input_key="prompt", label_key="label"),
        seed=0,
        max_context=64,
    )
    assert len(skip) == 2 and skip.num_dropped_long == 1 and skip.num_bad_rows == 0
    assert "or the model's context of 64 tokens" in skip.report()[0]
    # A prompt one token shorter than the context leaves room for one response token: kept.
    fits = PromptDataset(
        prompts,
        CharTokenizer(),
        DataConfig(input_key="prompt", label_key="label"),
        seed=0,
        max_context=len(long_prompt) + 1,
    )
    assert len(fits) == 3
    with pytest.raises(DataError, match="line 2: a prompt of 72 tokens"):
        PromptDataset(
            prompts,
            CharTokenizer(),
            DataConfig(input_key="prompt", label_key="label"),
            seed=0,
            max_context=len(long_prompt),
        )


# ---------------------------------------------------------------- hook errors at validation (exit 2, nothing starts)


@pytest.mark.parametrize(
    ("source", "fn", "what"),
    [
        ("def score(args, sample):\n    return 1.0 +\n", "score", "SyntaxError: invalid syntax ({file}:2)"),
        ("import no_such_dependency_h10\n", "score", "importing it raised ModuleNotFoundError: No module named "
         "'no_such_dependency_h10' ({file}:1)"),
        ("x = 1\nraise RuntimeError('no API key')\n", "score", "importing it raised RuntimeError: no API key "
         "({file}:2)"),
        ("def scor(args, sample):\n    return 1.0\n", "score", "{file} has no function 'score'"),
    ],
    ids=["syntax", "import", "raises", "missing-function"],
)  # fmt: skip
def test_hook_configuration_errors_exit_2_naming_flag_path_file_and_line(tmp_path, capsys, source, fn, what):
    path = _hook(tmp_path, "my_reward", source)
    out = tmp_path / "out"
    assert main(["--custom-rm-path", f"{path}:{fn}", "--output-dir", str(out)]) == EXIT_BAD_INPUT
    _, err = _err_lines(capsys)
    assert err == [f"rlcore-run: --custom-rm-path {path}:{fn}: " + what.format(file=path)]
    assert not out.exists()  # found at validation: no model was built, Ray did not start


def test_every_hook_flag_is_resolved_at_validation_from_the_working_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _hook(tmp_path, "cwd_hooks_h10", "def generate(args, sample, sampling_params):\n    return sample\n")
    flags = ["--custom-rm-path", "--custom-generate-function-path", "--dynamic-sampling-filter-path"]
    for flag in flags:
        # A module in the working directory is found, as with `python -m`; a missing function is found now.
        assert main([flag, "cwd_hooks_h10:nothing_here", "--output-dir", str(tmp_path / "out")]) == EXIT_BAD_INPUT
        _, err = _err_lines(capsys)
        assert err == [f"rlcore-run: {flag} cwd_hooks_h10:nothing_here: {tmp_path}/cwd_hooks_h10.py has no function "
                       "'nothing_here'"]  # fmt: skip
    assert main(["--custom-rm-path", "elsewhere_h10:score", "--output-dir", str(tmp_path / "out")]) == EXIT_BAD_INPUT
    _, err = _err_lines(capsys)
    assert err[0].startswith("rlcore-run: --custom-rm-path elsewhere_h10:score: no module named 'elsewhere_h10' (the ")
    assert f"working directory '{tmp_path}' is on the import path" in err[0]
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- hook errors mid-run (HookFailure), without Ray


class _NoEngines:
    def rewind(self):
        pass


def _rollout(custom_generate, filter_fn=None, hub=None):
    counter = iter(range(10**6))

    def next_prompts(n):
        return [Sample(index=next(counter), prompt="c1=", tokens=[1, 2, 3], label="1") for _ in range(n)]

    ctx = RolloutContext(engines=_NoEngines(), tokenizer=None, args=None)
    return asyncio.run(
        collect_rollout(
            ctx,
            next_prompts,
            hub or RewardHub(RewardConfig(rm_type="exact_match")),
            rollout_batch_size=2,
            n_samples=2,
            params=SamplingParams(max_new_tokens=4),
            filter_fn=filter_fn,
            custom_generate=custom_generate,
        )
    )


GENERATE = """
from runtime.rollout.sample import Sample

async def answers(args, sample, sampling_params):
    sample.tokens = list(sample.tokens) + [7]
    sample.response, sample.response_length, sample.loss_mask = "1", 1, [1]
    sample.rollout_log_probs, sample.status = [0.0], Sample.Status.COMPLETED
    return sample

async def returns_none(args, sample, sampling_params):
    return None

async def raises(args, sample, sampling_params):
    tool = {}
    return tool["search"]

def never(args, samples, **kwargs):
    return SimpleNamespace(keep=False, reason="never")

from types import SimpleNamespace
"""


def test_a_generate_hook_that_raises_or_returns_the_wrong_type_is_a_hook_failure(tmp_path):
    path = _hook(tmp_path, "gen_hooks", GENERATE)
    flag = "--custom-generate-function-path"
    samples, _, _ = _rollout(resolve_hook(flag, f"{path}:answers"))
    assert [s.response for s in samples] == ["1"] * 4
    with pytest.raises(HookFailure) as info:
        _rollout(resolve_hook(flag, f"{path}:returns_none"))
    assert str(info.value) == (
        f"{flag} {path}:returns_none: returned NoneType None, expected a Sample or a list of Samples ({path}:9)"
    )
    with pytest.raises(HookFailure) as info:
        _rollout(resolve_hook(flag, f"{path}:raises"))
    assert str(info.value) == f"{flag} {path}:raises: raised KeyError: 'search' ({path}:14)"


def test_a_filter_that_keeps_nothing_is_one_line(tmp_path):
    path = _hook(tmp_path, "gen_filters", GENERATE)
    answers = resolve_hook("--custom-generate-function-path", f"{path}:answers")
    with pytest.raises(JobError) as info:
        _rollout(answers, filter_fn=load_filter(f"{path}:never"))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        f"--dynamic-sampling-filter-path {path}:never kept 0 of 64 groups in 32 sampling rounds, short of "
        "--rollout-batch-size 2: the job stops"
    )
    assert "{'never': 64}" in message


# ---------------------------------------------------------------- rewards: timeouts for async calls, the error rate


def test_a_blocking_async_reward_is_timed_out_and_never_stalls_the_rollout(tmp_path):
    path = _hook(
        tmp_path,
        "blocking_async",
        """
        import time

        async def reward(args, sample, **kwargs):
            if sample.index == 0:
                time.sleep(30)  # a synchronous client inside an async def: blocks whatever runs it
            return 1.0
        """,
    )
    hub = RewardHub(RewardConfig(custom_rm_path=f"{path}:reward", reward_timeout=0.5))
    samples = [Sample(index=i, response="1", label="1") for i in range(4)]
    start = time.perf_counter()
    assert asyncio.run(hub.score(samples)) == [0.0, 1.0, 1.0, 1.0]
    assert time.perf_counter() - start < 3.0
    metrics = hub.pop_metrics()
    assert (metrics["reward/timeouts"], metrics["reward/errors"]) == (1, 0)
    assert reward_error_rate(metrics) == 0.25


def test_reward_errors_stop_the_job_after_consecutive_steps_over_the_rate():
    cfg = from_dict(max_reward_error_rate=0.5, max_reward_error_steps=3)
    rates: list[float] = []
    for rate in (0.6, 0.9, 0.5, 1.0, 0.75):
        rates.append(rate)
        check_reward_errors(rates, cfg, reward="r")  # 0.5 is not over 0.5: the run of 3 restarts
    rates.append(0.51)
    with pytest.raises(JobError, match=r"reward r: 100%, 75%, 51% of the samples' rewards failed or timed out in the "
                       r"last 3 steps, over --max-reward-error-rate 0.5"):  # fmt: skip
        check_reward_errors(rates, cfg, reward="r")
    check_reward_errors([1.0] * 5, from_dict(max_reward_error_rate=1.0), reward="r")  # 1 never stops


# ---------------------------------------------------------------- checkpoints and the metrics file, without Ray


class _FakeTrainers:
    def __init__(self, fail: bool):
        self.fail = fail

    def save(self, path, *, with_optimizer=True):
        Path(path).mkdir(parents=True)
        (Path(path) / "shard.distcp").write_bytes(b"x" * 1000)
        if self.fail:
            raise OSError(errno.ENOSPC, "No space left on device")


class _FakeFeed:
    def state_dict(self):
        return {"data": {}}


class _FakeEngines:
    def get_rng_state(self):
        return []


def test_manifest_names_the_corrupt_file_and_a_failed_save_leaves_no_partial_folder(tmp_path):
    root = tmp_path / "ckpt"
    kw = {"engines": _FakeEngines(), "feed": _FakeFeed()}
    folder = checkpoint.save(root, 2, trainers=_FakeTrainers(fail=False), **kw)
    assert checkpoint.verify(checkpoint.resolve(root)) == 2
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
    assert set(manifest["files"]) == {"loop_state.pt", "trainer/shard.distcp"}

    with pytest.raises(checkpoint.SaveError, match=r"--save .*: saving step 4 failed \(OSError: .*No space left"):
        checkpoint.save(root, 4, trainers=_FakeTrainers(fail=True), **kw)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002"]  # no step_000004, no partial
    assert (root / "latest").read_text() == "step_000002"

    shard = folder / "trainer" / "shard.distcp"
    shard.write_bytes(b"x" * 999)  # truncated
    with pytest.raises(
        checkpoint.CheckpointError, match=f"file '{shard}' is corrupt: 999 bytes, the manifest says 1000"
    ):
        checkpoint.verify(folder)
    shard.write_bytes(b"y" * 1000)  # same size, other bytes
    with pytest.raises(checkpoint.CheckpointError, match="SHA-256 differs"):
        checkpoint.verify(folder)


def test_repair_rows_drops_a_torn_line_and_the_rows_to_run_again(tmp_path):
    path = tmp_path / METRICS_FILE
    rows = [json.dumps({"step": s, "x": s}) for s in (0, 1, 2, 1)]
    path.write_text("\n".join(rows) + '\n{"step": 3, "x": 0.2')
    assert repair_rows(path, before_step=2) == {"kept": 3, "dropped_later": 1, "dropped_unreadable": 1}
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 1]
    assert repair_rows(tmp_path / "missing.jsonl", before_step=1)["kept"] == 0


# ---------------------------------------------------------------- checkpoint and --save errors at validation


def test_save_must_be_a_creatable_directory(tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    for save, problem in (
        (tmp_path / "a_file", "exists and is not a directory"),
        (tmp_path / "a_file" / "ckpt", f"cannot be created: '{tmp_path / 'a_file'}' is a file"),
    ):
        assert main(["--save", str(save), "--output-dir", str(tmp_path / "out")]) == EXIT_BAD_INPUT
        _, err = _err_lines(capsys)
        assert err == [f"rlcore-run: --save {save}: {problem}"]
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- jobs that start (one Ray session)


def test_a_hook_failing_mid_run_saves_the_last_step_then_resume_repairs_the_metrics(ray_session, tmp_path, capsys):
    # 1. A generate hook that works for the first step (16 samples) and then raises: exit 1, one line, step 1 saved.
    path = _hook(
        tmp_path,
        "flaky_generate",
        """
        from runtime.rollout import generate

        calls = 0

        async def flaky(args, sample, sampling_params):
            global calls
            calls += 1
            if calls > 16:
                raise ConnectionError("tool server down")
            return await generate(args, sample, sampling_params)
        """,
    )
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    job = [*SMALL, "--output-dir", str(out), "--save", str(ckpt), "--num-rollout", "3"]
    assert main([*job, "--custom-generate-function-path", f"{path}:flaky"]) == EXIT_JOB_STOPPED
    stdout, err = _err_lines(capsys)
    assert err == [f"rlcore-run: --custom-generate-function-path {path}:flaky: raised ConnectionError: tool server "
                   f"down ({path}:9)"]  # fmt: skip
    assert f"rlcore-run: saved step 1 to {ckpt / 'step_000001'}; resume with --load {ckpt}" in stdout
    assert (ckpt / "latest").read_text() == "step_000001"
    assert checkpoint.verify(ckpt / "step_000001") == 1
    assert [r["step"] for r in read_metrics(out / METRICS_FILE)] == [0]

    # 2. Resuming at or past --num-rollout is refused with both numbers, a corrupt checkpoint file is named: exit 2.
    assert main([*job, "--load", str(ckpt), "--num-rollout", "1"]) == EXIT_BAD_INPUT
    _, err = _err_lines(capsys)
    assert err == [f"rlcore-run: --load {ckpt}: the checkpoint is at step 1, at or past --num-rollout 1: nothing is "
                   "left to train and final_model/ is exported (raise --num-rollout to go on)"]  # fmt: skip
    loop_state = ckpt / "step_000001" / checkpoint.LOOP_STATE
    intact = loop_state.read_bytes()
    loop_state.write_bytes(intact[:-10])
    assert main([*job, "--load", str(ckpt)]) == EXIT_BAD_INPUT
    _, err = _err_lines(capsys)
    assert err == [f"rlcore-run: --load: checkpoint file '{loop_state}' is corrupt: {len(intact) - 10} bytes, the "
                   f"manifest says {len(intact)}"]  # fmt: skip
    loop_state.write_bytes(intact)

    # 3. A crash left a row of the step to rerun and a torn line; resume (with an async reward that blocks on one
    # sample in four, past --reward-timeout): each step has one row, and the blocked calls are timed out and killed.
    with open(out / METRICS_FILE, "a") as fh:
        fh.write(json.dumps({"step": 1, "stale": 1}) + '\n{"step": 2, "rollout/rew')
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    reward = _hook(
        tmp_path,
        "blocking_reward",
        f"""
        import os
        import time
        from pathlib import Path

        from runtime.demo import task

        async def reward(args, sample, **kwargs):
            if sample.index % 4 == 0:
                Path({str(blocked)!r}, str(os.getpid())).touch()
                time.sleep(60)
            return task.score(sample.response, sample.label)
        """,
    )
    extra = ["--load", str(ckpt), "--custom-rm-path", f"{reward}:reward", "--reward-timeout", "1"]
    assert main([*job, *extra, "--max-reward-error-rate", "1"]) == 0
    stdout, _ = _err_lines(capsys)
    assert f"{out / METRICS_FILE}: dropped 1 unreadable (torn) lines" in stdout
    rows = read_metrics(out / METRICS_FILE)
    assert [r["step"] for r in rows] == [0, 1, 2] and len((out / METRICS_FILE).read_text().splitlines()) == 3
    assert "stale" not in rows[1] and all("train/loss" in r for r in rows)
    assert [r["step"] for r in read_metrics(out / LEDGER_FILE)] == [0, 1, 2]
    assert all(r["reward/num_scored"] == 16 for r in rows[1:])
    assert sum(r["reward/timeouts"] for r in rows[1:]) > 0 and all(r["reward/errors"] == 0 for r in rows[1:])
    # The blocked calls ran in worker processes, each killed at its timeout: none of them is left running, and no
    # thread of the hub's.
    pids = [int(p.name) for p in blocked.iterdir()]
    assert pids and os.getpid() not in pids
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert not [t for t in threading.enumerate() if t.name == "reward"]


def test_a_reward_that_always_fails_stops_the_job(ray_session, tmp_path, capsys):
    path = _hook(tmp_path, "down_reward", "def reward(args, sample, **kwargs):\n    raise OSError('reward down')\n")
    out = tmp_path / "out"
    args = [*SMALL, "--num-rollout", "6", "--custom-rm-path", f"{path}:reward", "--output-dir", str(out)]
    assert main(args) == EXIT_JOB_STOPPED
    _, err = _err_lines(capsys)
    assert err == [f"rlcore-run: reward {path}:reward: 100%, 100%, 100% of the samples' rewards failed or timed out "
                   "in the last 3 steps, over --max-reward-error-rate 0.5 for --max-reward-error-steps 3: the job "
                   "stops (the log holds each step's first reward error with its traceback)"]  # fmt: skip
    # Two steps trained on zeros; the third step's rollout stopped the job before it trained.
    assert [r["step"] for r in read_metrics(out / METRICS_FILE)] == [0, 1]


def test_a_filter_that_keeps_nothing_stops_the_job_in_one_line(ray_session, tmp_path, capsys):
    path = _hook(tmp_path, "strict_filter", GENERATE)
    args = [*SMALL, "--num-rollout", "2", "--output-dir", str(tmp_path / "out")]
    assert main([*args, "--dynamic-sampling-filter-path", f"{path}:never"]) == EXIT_JOB_STOPPED
    _, err = _err_lines(capsys)
    assert len(err) == 1
    assert err[0].startswith(
        f"rlcore-run: --dynamic-sampling-filter-path {path}:never kept 0 of 128 groups in 32 sampling rounds, short "
        "of --rollout-batch-size 4: the job stops"
    )


# ---------------------------------------------------------------- exposure: a single-node job listens on loopback only


@pytest.mark.slow  # an audit drill: a whole job of its own, its sockets listed (~40 s); `make test-slow` runs it
def test_every_listening_socket_of_a_single_node_job_is_on_loopback(tmp_path):
    # A job of its own (this process's Ray is not the job's): two trainers, so torch's rendezvous store runs too.
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "runtime.cli", *SMALL, "--num-rollout", "4", "--actor-num-gpus-per-node", "2",
           "--output-dir", str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != loopback.RAY_CLUSTER_ENV}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    listeners: dict[tuple[str, int], str] = {}
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if (out / METRICS_FILE).exists() and (out / METRICS_FILE).read_text().count("\n") >= 1:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        # Every process of the job: the driver, Ray's servers and agents it started, the actors under the raylet.
        job = psutil.Process(proc.pid)
        for p in [job, *job.children(recursive=True)]:
            try:
                connections, name = p.net_connections(kind="inet"), p.name()
            except psutil.Error:  # a worker that exited meanwhile
                continue
            for c in connections:
                if c.status == psutil.CONN_LISTEN:
                    listeners[(c.laddr.ip, c.laddr.port)] = name
    finally:
        assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
    names = list(listeners.values())
    assert {"gcs_server", "raylet"} <= set(names), listeners
    # Each trainer's Ray worker and gloo listeners, and rank 0's rendezvous store, were seen.
    assert sum(name.startswith("ray::TrainerWorker") for name in names) >= 5, listeners
    exposed = {address: name for address, name in listeners.items() if not loopback.is_loopback(address[0])}
    assert not exposed


def test_loopback_addresses():
    assert all(map(loopback.is_loopback, ["127.0.0.1", "127.0.1.1", "::1", "::ffff:127.0.0.1"]))
    assert not any(map(loopback.is_loopback, ["0.0.0.0", "::", "192.0.2.2", "::ffff:10.0.0.1", "fe80::1%eth0"]))
