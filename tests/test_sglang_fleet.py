"""The managed SGLang fleet: servers launched through the launcher (the fake server as ``--sglang-server-command``),
the real SGLang router (the ``sglang-router`` package, its Rust router on the CPU) in front of them."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import ray
import torch
from fake_sglang import FakeSGLangServer
from transformers import AutoTokenizer

from rlcore.advantages import sequence_advantages
from runtime.cluster.engines import EngineGroup
from runtime.cluster.placement import create_placement
from runtime.cluster.trainers import TrainerGroup
from runtime.cluster.weight_sync import DistributedSync, check_weights_equal, make_weight_sync
from runtime.config import from_dict, validate
from runtime.demo import task
from runtime.demo.tiny_model import make_tiny_model
from runtime.engines import SamplingParams, launcher
from runtime.logger import METRICS_FILE, read_metrics
from runtime.loop import run
from runtime.rollout import generation
from runtime.rollout.generation import RolloutContext, _running, engine_generate, expand_groups, generate_groups
from runtime.rollout.replay import load_rollout_data
from runtime.rollout.sample import Sample
from runtime.train.algo import advantage_config, loss_config, model_roles
from runtime.train.batch import build_batch

pytest.importorskip("sglang_router", reason="the router tests need the sglang-router package (the dev extra)")

FAKE_SERVER = f"{sys.executable} {Path(__file__).with_name('fake_sglang.py')}"
PARAMS = SamplingParams(max_new_tokens=2)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), alphabet=task.ALPHABET, seed=0))


# ray_session (tests/conftest.py) starts Ray with these; shared with neighbouring modules that ask for the same.
# 4 CPUs, more than the 3 slots a job here takes: the fault-tolerance modules' size, so one Ray serves all four.
RAY_RESOURCES = {"num_cpus": 4}


def fleet_cfg(tmp_path, model_path, **overrides):
    settings = {
        "output_dir": str(tmp_path),
        "hf_checkpoint": model_path,
        "rollout_max_response_len": 2,
        "rollout_batch_size": 2,
        "n_samples_per_prompt": 2,
        "num_rollout": 1,
        "actor_num_gpus_per_node": 1,
        "rollout_engine": "sglang",
        "rollout_num_gpus": 2,
        "sglang_server_command": FAKE_SERVER,
        "sglang_server_startup_timeout": 120.0,
    }
    return validate(from_dict(None, **{**settings, **overrides}))


def test_the_whole_loop_runs_on_launched_servers_behind_the_router(ray_session, model_path, tmp_path):
    # First in the module: the shared fleet below holds the CPU slots a job needs.
    cfg = fleet_cfg(
        tmp_path,
        model_path,
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        rollout_max_response_len=5,
        num_rollout=2,
        global_batch_size=8,
        micro_batch_size=4,
        lr=1e-3,
        use_tensorboard=False,
        check_weight_update_equal=True,
        # The servers release their memory while the trainer trains, and take it back in two stages.
        offload_rollout=True,
    )
    result = run(cfg, progress=False)
    rows = read_metrics(result.output_dir / METRICS_FILE)
    assert [r["step"] for r in rows] == [0, 1]
    # The servers sample with the trainer's weights at every step (pushed over the gloo group, checked equal after
    # the first push): their log-probs equal the trainer's recompute.
    assert all(r["train/rollout_log_prob_abs_diff"] < 1e-4 for r in rows)
    # The servers and the router the job launched are gone with it.
    deadline = time.monotonic() + 30
    while _launched_by(model_path) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _launched_by(model_path)


@pytest.mark.slow  # the job below runs the same pause through the router; this one checks the spans (~30 s)
def test_an_update_mid_rollout_pauses_the_server_and_the_rollout_goes_on_with_the_new_weights(
    ray_session, model_path, tmp_path
):
    # Every request is held after HOLD_AT tokens until the server's weights change: an update that waited for the
    # rollout in flight would never return; paused, it returns with every request still held mid-way.
    n, length, hold_at = 4, 6, 2
    other = make_tiny_model(tmp_path / "other", alphabet=task.ALPHABET, seed=1)
    with (
        FakeSGLangServer(model_path, hold_at=hold_at) as server,
        one_engine_fleet(tmp_path, model_path, sglang_url=server.url) as (_, engines, url),
    ):
        prompts = [[1 + i, 2, 3] for i in range(n)]
        rollout = engines.generate_async(prompts, SamplingParams(max_new_tokens=length, top_k=1))
        _until(lambda: len(server_info(url)["internal_states"][0]["held"]) == n)
        updated = threading.Event()

        def update() -> None:
            with engines.generation_paused():
                engines.update_weights_from_disk(str(other), weight_version=1)
            updated.set()

        threading.Thread(target=update, daemon=True).start()
        # Held requests finish only once the weights change, so an update that waited for them would never return.
        assert updated.wait(120), "the update waited for the rollout in flight"
        assert server_info(url)["internal_states"][0]["pauses"] == ["retract"]
        generations = [g for out in ray.get(rollout, timeout=120) for g in out]
        assert [g.extra["versions"] for g in generations] == [[0, 1]] * n
        assert all(g.finish_reason == "length" and len(g.token_ids) == length for g in generations)
        assert [s["end"] for g in generations for s in g.extra["weight_versions"]] == [hold_at, length] * n
        # Each prompt went to the server once: none was sent again or lost.
        assert server_info(url)["internal_states"][0]["requests"]["/generate"] == n
        assert engines.health() == [True]  # health checks are back on


def _until(condition, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _run_within(cfg, server, seconds: float) -> list:
    """Run the job ``cfg`` on a thread for at most ``seconds``, then stop ``server``: ``[its result]``, or ``[]`` if it
    did not finish (a job stuck waiting on the fake's held requests is left on its daemon thread)."""
    finished: list = []
    job = threading.Thread(target=lambda: finished.append(run(cfg, progress=False)), daemon=True)
    job.start()
    job.join(seconds)
    server.stop()
    return finished


def test_one_step_async_syncs_mid_rollout_by_pausing_the_servers_not_by_waiting_for_the_rollout(
    ray_session, model_path, tmp_path
):
    # The fake holds every request of the second rollout after HOLD_AT tokens until its weights change: a sync that
    # waited for that rollout to finish would never come (the job would hang), one that pauses the server, updates
    # and continues lets it finish. Before the shared fleet below, which holds the CPU slots a job needs.
    n, length, hold_at = 4, 6, 2
    saved = str(tmp_path / "rollouts" / "{rollout_id}.pt")
    server = FakeSGLangServer(model_path, hold_at=hold_at, hold_after=n).start()
    cfg = fleet_cfg(
        tmp_path,
        model_path,
        rollout_num_gpus=1,
        sglang_url=server.url,
        rollout_schedule="one_step",
        num_rollout=2,
        rollout_max_response_len=length,
        # Greedy and no eos: every response runs to its length, so a lost token would show.
        rollout_top_k=1,
        global_batch_size=n,
        micro_batch_size=n,
        lr=1e-3,
        use_tensorboard=False,
        save_debug_rollout_data=saved,
    )
    finished = _run_within(
        cfg, server, 300
    )  # (20-45 s on two busy cores; a sync that waits for the held rollout never ends)
    assert finished, "the job did not finish: the weight sync waited for the held rollout"
    # Both syncs (after steps 0 and 1) paused the server in retract mode; each prompt was sent once.
    assert server.pauses == ["retract", "retract"] and server.requests["/generate"] == 2 * n
    rows = read_metrics(finished[0].output_dir / METRICS_FILE)
    assert [r["step"] for r in rows] == [0, 1]
    first, second = (load_rollout_data(saved, step) for step in (0, 1))
    # The first rollout ran before any sync; the second was sampled by version 0 up to the sync mid-way, by version 1
    # (the weights after step 0) from there on. No sample lost or repeated, none cut short.
    assert [s.weight_versions for s in first] == [["0"]] * n
    assert [s.weight_versions for s in second] == [["0", "1"]] * n
    for samples in (first, second):
        assert sorted(collections.Counter(s.index for s in samples).values()) == [2, 2]  # 2 prompts x 2 samples
        assert all(s.response_length == length and s.status == Sample.Status.TRUNCATED for s in samples)
    assert not {s.index for s in first} & {s.index for s in second}
    assert rows[1]["rollout/weight_version_lag_max"] == 1


def test_fully_async_syncs_by_pausing_the_servers_neither_draining_nor_cutting_off(ray_session, model_path, tmp_path):
    # --max-staleness 1, 2 groups x 2 samples a step: steps 0 and 1's 8 requests are admitted (and sent: the router
    # client takes 512 at once) at the start, step 2's 4 only after the sync that follows step 0 (the admission bound).
    # The fake holds those 4 after HOLD_AT tokens until its weights change, so the sync after step 1 finds them in
    # flight: one that drained them (or aborted them: a held request does not end on /abort_request) would never come;
    # one that pauses the server, updates and continues lets them finish with the new weights. --partial-rollout is on:
    # paused, nothing is cut off even so.
    n, length, hold_at = 4, 6, 2
    saved = str(tmp_path / "rollouts" / "{rollout_id}.pt")
    server = FakeSGLangServer(model_path, hold_at=hold_at, hold_after=2 * n, hold_count=n).start()
    cfg = fleet_cfg(
        tmp_path,
        model_path,
        rollout_num_gpus=1,
        sglang_url=server.url,
        rollout_schedule="fully_async",
        max_staleness=1,
        partial_rollout=True,
        num_rollout=3,
        rollout_max_response_len=length,
        rollout_top_k=1,  # greedy and no eos: every response runs to its length, so a lost token would show
        global_batch_size=n,
        micro_batch_size=n,
        lr=1e-3,
        use_tensorboard=False,
        save_debug_rollout_data=saved,
    )
    finished = _run_within(
        cfg, server, 300
    )  # (about 30 s on two busy cores; a sync that waits for held ones never ends)
    assert finished, "the job did not finish: the weight sync waited for the held requests"
    # Every sync (after steps 0, 1 and 2) paused the server in retract mode; nothing was aborted.
    assert server.pauses == ["retract"] * 3 and server.requests.get("/abort_request", 0) == 0
    rows = read_metrics(finished[0].output_dir / METRICS_FILE)
    assert [r["step"] for r in rows] == [0, 1, 2]
    steps = [load_rollout_data(saved, step) for step in range(3)]
    # Steps 0 and 1 were sampled by the launch weights; step 2's, admitted at version 1, by version 1 up to the sync
    # mid-way and by version 2 from there on: it counts by its oldest version, one behind step 2's trainers.
    assert [[s.weight_versions for s in samples] for samples in steps] == [[["0"]] * n, [["0"]] * n, [["1", "2"]] * n]
    assert [r["rollout/weight_version_lag_max"] for r in rows] == [0, 1, 1]
    for samples in steps:
        assert sorted(collections.Counter(s.index for s in samples).values()) == [2, 2]  # 2 prompts x 2 samples
        assert all(s.response_length == length and s.status == Sample.Status.TRUNCATED for s in samples)
        assert all(s.loss_mask == [1] * length for s in samples)  # the tokens of before the sync train too
    assert len({s.index for samples in steps for s in samples}) == 6  # no prompt trained twice


# The external server that restart_in_place_at_step_one restarts, and what it saw (the hook runs in this process).
_RESTARTED: dict = {}


def restart_in_place_at_step_one(rollout_id, args, samples, metrics, rollout_time):
    """--custom-rollout-log-function-path: after step 1's rollout (the server holds version 1 since the sync after
    step 0; nothing generates now), restart the external server on its port, as its process would come back, faster
    than any request could meet its death. Then wait (the job waits too) until it holds version 1 again."""
    if rollout_id != 1:
        return False
    state = _RESTARTED
    state["before"] = state["server"].weight_version
    state["server"].stop()
    state["server"] = server = FakeSGLangServer(state["model"], port=state["port"]).start()
    deadline = time.monotonic() + 60  # (the health check runs every second; a reload takes a few)
    while server.weight_version != "1" and time.monotonic() < deadline:
        time.sleep(0.05)
    state["after"] = server.weight_version
    return False


def test_an_external_server_restarted_between_steps_is_noticed_by_its_weight_version_and_reloaded(
    ray_session, model_path, tmp_path, capsys
):
    # A restarted external server answers every liveness check with its launch weights; the health check compares
    # the version it reports with the one loaded into it last, treats the difference as a death and the engine group
    # loads the trainers' weights into it again. Without that, step 2 would sample from the launch weights labelled 1.
    port = launcher.free_port()
    _RESTARTED.clear()
    _RESTARTED.update(model=model_path, port=port, server=FakeSGLangServer(model_path, port=port).start())
    cfg = fleet_cfg(
        tmp_path,
        model_path,
        rollout_num_gpus=1,
        sglang_url=f"http://127.0.0.1:{port}",
        num_rollout=3,
        rollout_max_response_len=4,
        global_batch_size=4,
        micro_batch_size=4,
        lr=1e-3,
        use_tensorboard=False,
        rollout_health_check_interval=1.0,
        custom_rollout_log_function_path=f"{__name__}.restart_in_place_at_step_one",
    )
    try:
        result = run(cfg, progress=False)
    finally:
        _RESTARTED["server"].stop()
    assert _RESTARTED["before"] == "1" and _RESTARTED["after"] == "1", _RESTARTED
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("rlcore-run: rollout engine 0")]
    assert lines[0] == (
        "rlcore-run: rollout engine 0 the health check failed (SGLangWeightsLost: SGLang server "
        f"http://127.0.0.1:{port} reports weight version 'default', not '1' (the one loaded into it last): it "
        "restarted with its launch weights, or another client updated it); restarting it"
    )
    rows = read_metrics(result.output_dir / METRICS_FILE)
    assert [r["step"] for r in rows] == [0, 1, 2] and sum(r["engines/restarts"] for r in rows) == 1
    # Nothing lost, and every step sampled by the trainers' weights (the fake computes in float32).
    assert all(r["reward/num_scored"] == 4 for r in rows)
    assert all(r["train/rollout_log_prob_abs_diff"] < 1e-4 for r in rows)


@contextlib.contextmanager
def one_engine_fleet(tmp_path, model_path, **overrides):
    """One launched fake server behind the real router (its own, torn down on exit: before the shared fleet below
    takes the CPU slots)."""
    cfg = fleet_cfg(tmp_path, model_path, rollout_num_gpus=1, **overrides)
    placement = create_placement(cfg)
    engines = EngineGroup(cfg, placement, model_path)
    try:
        yield cfg, engines, ray.get(engines.actors[0].url.remote())
    finally:
        engines.shutdown()
        ray.util.remove_placement_group(placement.group)


@pytest.mark.slow  # slowed decoding held in flight (~35 s); `make test-slow` runs it
def test_requests_in_flight_through_the_router_are_bounded_by_server_concurrency(ray_session, model_path, tmp_path):
    # Slowed decoding keeps every request in flight long enough to overlap.
    slow = f"env FAKE_SGLANG_TOKEN_DELAY=0.05 {FAKE_SERVER}"
    with one_engine_fleet(tmp_path, model_path, sglang_server_command=slow, sglang_server_concurrency=3) as fleet:
        _, engines, url = fleet
        assert engines.request_limit == 3  # slime's bound: --sglang-server-concurrency x 1 engine
        prompts = [[1 + i % 5, 2, 3] for i in range(12)]
        generations = asyncio.run(engines.generate(prompts, SamplingParams(max_new_tokens=4)))
        assert len(generations) == 12 and all(g.token_ids for g in generations)
        # All 12 went out at once; the server saw at most 3 at a time, and 3 did overlap.
        assert server_info(url)["internal_states"][0]["peak_running_requests"] == 3


def _launched_by(model_path: str) -> list[str]:
    """Command lines of the running fake servers of ``model_path`` (this test's own: the folder is unique)."""
    import psutil

    running = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if "fake_sglang.py" in cmdline and model_path in cmdline:
            running.append(cmdline)
    return running


@pytest.fixture(scope="module")
def fleet(ray_session, model_path, tmp_path_factory):
    cfg = fleet_cfg(
        tmp_path_factory.mktemp("fleet"),
        model_path,
        sglang_args={"mem_fraction_static": 0.5, "enable_memory_saver": True},
        # manual: the routing key picks the server (sticky per key); requests without one go to a random server.
        router_args={"policy": "manual", "health_check_interval_secs": 1, "health_failure_threshold": 1},
        num_gpus_per_node=3,
    )
    placement = create_placement(cfg)
    engines = EngineGroup(cfg, placement, model_path)
    yield cfg, engines, placement
    engines.shutdown()
    ray.util.remove_placement_group(placement.group)


def server_info(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=10).json()


def generate_counts(urls: list[str]) -> list[int]:
    return [server_info(u)["internal_states"][0]["requests"].get("/generate", 0) for u in urls]


def test_servers_are_launched_with_the_passthrough_flags(fleet):
    cfg, engines, _ = fleet
    urls = [ray.get(a.url.remote()) for a in engines.actors]
    assert len(urls) == 2 and len(set(urls)) == 2 and engines.router_url not in urls
    for i, url in enumerate(urls):
        info = server_info(url)
        assert info["mem_fraction_static"] == 0.5 and info["enable_memory_saver"] is True
        # slime's seeds, from --num-gpus-per-node (3 here, 8 by default).
        assert info["random_seed"] == cfg.seed + 3 * i and info["tp_size"] == 1
        assert info["model_path"] == cfg.model.hf_checkpoint
    assert engines.health() == [True, True]


def test_the_routers_metrics_listen_where_the_router_does(fleet):
    """The router's Prometheus server binds the router's own address (127.0.0.1 in a single-node job, see
    runtime.cluster.loopback), not the router's default of 0.0.0.0 (every interface)."""
    import psutil

    _, engines, _ = fleet
    host, port = engines.router_url.removeprefix("http://").rsplit(":", 1)

    def listening(proc: psutil.Process) -> set[tuple[str, int]]:
        try:
            return {(c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="inet") if c.status == "LISTEN"}
        except psutil.Error:
            return set()

    (router,) = [p for p in psutil.process_iter() if (host, int(port)) in listening(p)]
    deadline = time.time() + 30
    while len(listening(router)) < 2 and time.time() < deadline:  # the metrics server may bind a moment later
        time.sleep(0.2)
    sockets = listening(router)
    # The request port and the Prometheus port.
    assert len(sockets) >= 2 and {ip for ip, _ in sockets} == {host}, sockets


def test_requests_go_through_the_router_and_are_spread_over_the_servers(fleet):
    _, engines, _ = fleet
    urls = [ray.get(a.url.remote()) for a in engines.actors]
    before = generate_counts(urls)
    prompts = [[1 + i % 5, 2, 3] for i in range(16)]
    refs = engines.generate_async(prompts, PARAMS)
    generations = ray.get(refs, timeout=120)
    assert len(refs) == 16 and all(len(g) == 1 and len(g[0].token_ids) >= 1 for g in generations)
    delta = [a - b for a, b in zip(generate_counts(urls), before, strict=True)]
    assert sum(delta) == 16 and min(delta) > 0, delta


def test_a_session_sticks_to_one_server(fleet):
    _, engines, _ = fleet
    urls = [ray.get(a.url.remote()) for a in engines.actors]
    for session in ("session-a", "session-b", "session-c"):
        before = generate_counts(urls)
        for _ in range(4):
            ray.get(engines.generate_async([[1, 2, 3]], PARAMS, session_ids=[session]), timeout=60)
        delta = [a - b for a, b in zip(generate_counts(urls), before, strict=True)]
        assert sorted(delta) == [0, 4], (session, delta)


def test_a_multi_turn_samples_turns_stay_on_one_server(fleet):
    _, engines, _ = fleet
    urls = [ray.get(a.url.remote()) for a in engines.actors]
    samples = expand_groups([Sample(tokens=[1, 2, 3])], 2, first_group=7)[0]
    assert [s.session_id for s in samples] == ["7-0", "7-1"]

    async def conversation(sample):
        for _ in range(3):  # three turns, each continuing the conversation so far
            generation = await engine_generate(sample.tokens, PARAMS.to_dict(), session_id=sample.session_id)
            sample.tokens = sample.tokens + generation.token_ids + [4]

    for sample in samples:
        before = generate_counts(urls)
        with _running(RolloutContext(engines=engines, tokenizer=None, args=None)):
            asyncio.run(conversation(sample))
        delta = [a - b for a, b in zip(generate_counts(urls), before, strict=True)]
        assert sorted(delta) == [0, 3], (sample.session_id, delta)


def test_a_rollout_through_the_router_sends_slimes_seeds_and_samples_alike_again(fleet, model_path):
    # On the shared fleet (two servers behind the router; a sample's session key keeps it on one of them): the seed,
    # not the server, fixes what a request samples. Before the weights test below, which changes the weights.
    cfg, engines, _ = fleet
    urls = [ray.get(a.url.remote()) for a in engines.actors]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ctx = RolloutContext(engines=engines, tokenizer=tokenizer, args=cfg, sampling_seed=cfg.data.rollout_seed)
    params = SamplingParams(max_new_tokens=6, temperature=1.5)

    def rollout(custom_generate=None):
        prompts = [Sample(tokens=[1, 2, 3]), Sample(tokens=[4, 5, 6])]
        groups = expand_groups(prompts, 3, first_group=0)
        whole, aborted = asyncio.run(generate_groups(ctx, groups, params, custom_generate))
        assert not aborted
        return [[s.tokens for s in g] for g in whole]

    def seeds_sent(since):
        seen = [server_info(u)["internal_states"][0]["sampling_seeds"] for u in urls]
        return [seed for start, seeds in zip(since, seen, strict=True) for seed in seeds[start:]]

    def mark():
        return [len(server_info(u)["internal_states"][0]["sampling_seeds"]) for u in urls]

    start = mark()
    first = rollout()
    # slime's seeds: --rollout-seed (42) + the sample's place in its group, on every request.
    assert cfg.data.rollout_seed == 42 and sorted(seeds_sent(start)) == [42, 42, 43, 43, 44, 44]
    assert all(len({tuple(t) for t in group}) > 1 for group in first)  # a group's samples differ
    # Other traffic in between (another rollout's, a resumed job's fresh engines): the same samples again.
    asyncio.run(engines.generate([[7, 7]], PARAMS))
    assert rollout() == first
    # A slime-style custom generate function gets the seed in its sampling_params and samples alike too.
    received = []

    async def custom(args, sample, sampling_params):
        received.append(sampling_params["sampling_seed"])
        return await generation.generate(args, sample, sampling_params)

    assert rollout(custom) == first
    assert sorted(received) == [42, 42, 43, 43, 44, 44]


def _train_one_step(trainers, cfg, model_path, seed):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    samples = []
    for i, rec in enumerate(task.make_records(8, seed=seed)):
        prompt = tokenizer(rec["prompt"])["input_ids"]
        samples.append(
            Sample(index=i // 4, group_index=i // 4, tokens=prompt + [5, 6], response_length=2, reward=float(i % 2))
        )
    adv_cfg = advantage_config(cfg)
    batch = sequence_advantages(build_batch(samples, pad_token_id=tokenizer.pad_token_id), adv_cfg)
    trainers.train_rollout(batch, global_batch_size=8, adv_cfg=adv_cfg)


def test_weights_reach_every_server_over_a_gloo_group_in_buckets(fleet, model_path):
    cfg, engines, placement = fleet
    urls = [ray.get(a.url.remote()) for a in engines.actors]
    trainers = TrainerGroup(
        placement,
        backend="torch",
        model_path=model_path,
        roles=model_roles(cfg),
        train_cfg=cfg.train,
        loss_cfg=loss_config(cfg),
        temperature=1.0,
        seed=0,
    )
    limit = 8192
    sync = make_weight_sync(trainers, engines, bucket_bytes=limit)  # SGLang's default transport: nccl (gloo here)
    try:
        assert isinstance(sync, DistributedSync) and sync.backend == "gloo"
        for version in (1, 2):
            weights = trainers.get_weights()
            before = [len(server_info(u)["internal_states"][0]["received_buckets"]) for u in urls]
            sync.push(version)
            # Every server holds the trainer's weights (all rows of every weight), with the version.
            assert check_weights_equal(trainers, engines, truncate_size=1 << 20) == len(weights)
            assert engines.weight_versions() == [version, version]
            for url, start in zip(urls, before, strict=True):
                assert httpx.get(url + "/model_info", timeout=10).json()["weight_version"] == str(version)
                received = server_info(url)["internal_states"][0]["received_buckets"][start:]
                # One update_weights_from_distributed call per bucket; none over the limit unless one tensor is.
                assert [b for b, _ in received] == sync.bucket_sizes and len(received) > 2
                assert all(size <= limit or n == 1 for size, n in received)
            assert sum(sync.bucket_sizes) == sum(v.nbytes for v in weights.values())
            _train_one_step(trainers, cfg, model_path, seed=version)
            assert any(not torch.equal(v, trainers.get_weights()[k]) for k, v in weights.items())
    finally:
        sync.close()
        trainers.shutdown()


def test_a_server_that_goes_away_is_dropped_and_nothing_hangs(fleet):
    # Runs last in this module: it stops a server of the shared fleet.
    _, engines, _ = fleet
    urls = [ray.get(a.url.remote()) for a in engines.actors]
    ray.get(engines.launchers[1].stop.remote(), timeout=60)
    start = time.monotonic()
    generations = ray.get(engines.generate_async([[1, 2, 3]] * 8, PARAMS), timeout=120)
    assert all(g[0].token_ids for g in generations)
    assert engines.health() == [True, False]
    deadline = time.monotonic() + 30
    while True:
        workers = httpx.get(engines.router_url + "/workers", timeout=10).json()["workers"]
        healthy = [w["url"] for w in workers if w["is_healthy"]]
        if healthy == [urls[0]] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert healthy == [urls[0]]
    assert time.monotonic() - start < 120
