"""``weight_transfer.send_bucket`` gives up a broadcast as soon as it is told a receiver failed, instead of waiting
for the group's timeout: a real gloo group of two processes whose receiver never receives."""

import multiprocessing
import time

import pytest
import torch

from runtime.engines import launcher, weight_transfer

# Large enough that the send cannot complete into the socket buffers without a receiver.
BIG = 16 * 1024 * 1024


def _join_and_idle(port: int, joined, release) -> None:
    group = weight_transfer.init_weights_update_group(
        master_address="127.0.0.1", master_port=port, rank=1, world_size=2, group_name=f"g{port}", backend="gloo",
        timeout=120,
    )  # fmt: skip
    joined.set()
    release.wait(120)  # a hung receiver: joined, never receives
    del group


@pytest.fixture
def idle_receiver():
    ctx = multiprocessing.get_context("spawn")
    port = launcher.free_port()
    joined, release = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_join_and_idle, args=(port, joined, release), daemon=True)
    proc.start()
    # A group name of its own: a process holds one group per name.
    group = weight_transfer.init_weights_update_group(
        master_address="127.0.0.1", master_port=port, rank=0, world_size=2, group_name=f"g{port}", backend="gloo",
        timeout=120,
    )  # fmt: skip
    assert joined.wait(60)
    yield group, proc
    # Event.set() waits for every process sleeping on it to wake: a receiver the test killed never does.
    if proc.is_alive():
        release.set()
        proc.join(10)
    if proc.is_alive():
        proc.kill()


def test_a_broadcast_told_of_a_failed_receiver_is_aborted_at_once(idle_receiver):
    group, _ = idle_receiver
    bucket = {"w": torch.ones(BIG // 4)}
    told = time.monotonic() + 1.0
    start = time.monotonic()
    with pytest.raises(weight_transfer.SendAborted, match="engine 1's receive failed"):
        weight_transfer.send_bucket(
            group,
            bucket,
            failed=lambda: "engine 1's receive failed" if time.monotonic() >= told else None,
            poll_s=0.01,
        )
    elapsed = time.monotonic() - start
    # Told after 1 s; the group's timeout is 120 s.
    assert 1.0 <= elapsed < 10, elapsed


def test_a_broadcast_whose_receiver_died_fails_without_waiting_for_the_timeout(idle_receiver):
    group, proc = idle_receiver
    proc.kill()
    proc.join(10)
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        weight_transfer.send_bucket(group, {"w": torch.ones(BIG // 4)}, failed=lambda: None)
    assert time.monotonic() - start < 30


def test_forming_a_group_whose_member_never_joins_fails_after_the_join_timeout():
    port = launcher.free_port()
    start = time.monotonic()
    message = r"weight-update group 'lonely' .*2 members.*rank 0 gave up after waiting 2 s"
    with pytest.raises(TimeoutError, match=message):
        weight_transfer.init_weights_update_group(
            master_address="127.0.0.1", master_port=port, rank=0, world_size=2, group_name="lonely", backend="gloo",
            timeout=120, join_timeout=2,
        )  # fmt: skip
    assert time.monotonic() - start < 30  # the join timeout, not the group's 120 s
