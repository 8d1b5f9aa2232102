"""The peer watch's decisions and the coordination service process, in this process.

A real coordination service and real JAX distributed-runtime clients (jaxlib's, the ones
`jax.distributed.initialize` makes) serve the watches' key-value store; time is a clock the
test moves. The end-to-end behaviour with killed and stopped processes is in
test_peer_loss.py.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from jaxtrain import TrainingArguments
from jaxtrain.checkpointing import committed_steps
from jaxtrain.errors import ArgumentError
from jaxtrain.parallel.coordinator import start_coordinator
from jaxtrain.parallel.peers import PeerWatch
from jaxtrain.parallel.progress import Position, ProgressBoard, Stuck


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def clients():
    """Three connected clients of one real coordination service."""
    from jaxlib import _jax

    address = f"127.0.0.1:{_free_port()}"
    service = _jax.get_distributed_runtime_service(address, 3, heartbeat_timeout=60)
    made = [
        _jax.get_distributed_runtime_client(address, i, init_timeout=30, heartbeat_timeout=60)
        for i in range(3)
    ]
    _all(made, "connect")  # a barrier: every client connects at once
    yield made
    _all(made, "shutdown")  # a barrier too
    service.shutdown()


def _all(clients, method: str) -> None:
    threads = [threading.Thread(target=getattr(c, method)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_silent_peer_is_lost_after_the_timeout_and_one_that_ended_normally_never(clients):
    clock, ended = Clock(), []
    watches = [
        PeerWatch(c, i, 3, 10.0, clock=clock, end=ended.append) for i, c in enumerate(clients)
    ]
    assert watches[0].interval == 1.0 and watches[0].silence_s == 8.0
    clock.now = 1.0
    for w in (*watches, watches[0]):  # process 0 sees the others' last beats at 1 s
        w.beat()
    watches[1].leave(error=False)  # process 1 ends normally (its exit hooks ran)
    clock.now = 8.5  # processes 1 and 2 stop beating; 0 goes on
    watches[0].beat()
    assert watches[0].check() is None  # 7.5 s of silence: not yet
    clock.now = 9.0
    watches[0].beat()
    verdict = watches[0].check()
    assert verdict == "lost process 2 of 3: no heartbeat for 8.0s"  # never process 1
    watches[0].lose(verdict)
    assert ended == [
        "jaxtrain: lost process 2 of 3: no heartbeat for 8.0s. No checkpoint directory was "
        "opened yet. Exiting with code 5; start every process again with the same command to "
        "resume."
    ]


def test_the_line_names_the_peers_host_and_the_newest_committed_checkpoint(clients, tmp_path):
    clock, ended = Clock(), []
    watches = [
        PeerWatch(c, i, 3, 5.0, clock=clock, end=ended.append) for i, c in enumerate(clients)
    ]
    watches[1].start()  # publishes its host and pid, then beats in its own thread
    watches[1].stop()
    watches[0].beat()
    root = tmp_path / "checkpoints"
    for name in ("2", "4", "6.orbax-checkpoint-tmp-123", "not-a-step"):
        (root / name).mkdir(parents=True)
    watches[0].checkpoints, watches[0].committed_steps = root, committed_steps
    clock.now = 5.0
    watches[0].beat()
    watches[0].lose(watches[0].check())
    assert f"lost process 1 of 3 (host {socket.gethostname()}, pid " in ended[0]
    assert "lost process 2 of 3: no heartbeat for 5.0s" in ended[0]
    # The uncommitted save of step 6 is not what a restart resumes from.
    assert f"Last committed checkpoint: step 4, {root / '4'}." in ended[0]


def test_a_peer_that_failed_first_is_named_and_the_first_reports_its_own_error(clients):
    ended: list[str] = []
    watches = [PeerWatch(c, i, 3, 2.0, end=ended.append) for i, c in enumerate(clients)]
    for w in watches:
        w.start()
    try:
        watches[2].fail(exit_code=2)  # the first failure: its own error is the one to print
        assert not ended and watches[2].exit_code == 2
        watches[0].fail(exit_code=1)  # e.g. its collective broke when process 2 exited
        assert (
            ended[0].startswith("jaxtrain: lost process 2 of 3 (host ")
            and "it ended on an error first (see its output)" in ended[0]
        )
        # Process 1, still working, is told: it gives up on process 2 within the timeout.
        deadline = time.monotonic() + 2 * watches[1].timeout_s
        while not any("lost process 2 of 3" in line for line in ended[1:]):
            assert time.monotonic() < deadline, ended
            time.sleep(0.05)
        assert "it ended on an error (see its output)" in ended[-1]
    finally:
        for w in watches:
            w.stop()


def test_a_beat_sent_before_a_peer_died_is_no_sign_of_life_after_it(clients):
    """Process 0's collective fails at t=1 (process 1 died). Process 1's beat published at
    0.5 s is read only at 1.2 s: it was sent before the failure and proves nothing; the
    next changed beat, unseen by a read sent after the failure, does (issue 40: process 0
    took the stale one for life and reported the collective's error, exit 1)."""
    clock = Clock()
    watches = [PeerWatch(c, i, 3, 10.0, clock=clock) for i, c in enumerate(clients)]
    watches[0].beat()  # t=0: no beat of the others yet
    clock.now = 0.5
    watches[1].beat()
    watches[2].beat()
    asked = clock.now = 1.0  # process 0 fails here
    clock.now = 1.2
    watches[0].beat()  # sees both beats of 0.5 s for the first time
    assert watches[0].unconfirmed(asked) == [1, 2]
    clock.now = 2.0
    watches[2].beat()  # process 2 is alive; process 1 died at 0.9 s
    watches[0].beat()
    assert watches[0].unconfirmed(asked) == [1]
    watches[1].leave(error=False)  # an ended peer is not waited for
    watches[0].beat()
    assert watches[0].unconfirmed(asked) == []


def test_the_progress_watch_names_the_process_behind_and_its_last_step(clients):
    clock, ended = Clock(), []
    watches = [
        PeerWatch(c, i, 3, 30.0, step_timeout_s=10.0, clock=clock, end=ended.append)
        for i, c in enumerate(clients)
    ]
    clock.now = 1.0
    for w, reached in zip(watches, (5, 3, 4)):  # process 1 stands after step 3
        for step in range(reached + 1):
            w.note_progress(step)
    for w in (*watches, *watches):  # everyone reads everyone's position
        w.beat()
    clock.now = 10.9
    for w in watches:
        w.beat()
    assert watches[0].check() is None
    clock.now = 11.0
    expected = (
        "is stuck: its training loop has not moved past step 3 for 10.0s (step_timeout_s=10; "
        "the furthest process is at step 5)"
    )
    assert watches[0].check() == f"process 1 of 3 {expected}"
    # Process 1 sees itself stand still too (its loop sleeps; its watch does not).
    host = f"host {socket.gethostname()}, pid {os.getpid()}, this process"
    assert watches[1].check() == f"process 1 of 3 ({host}) {expected}"
    watches[0].lose(watches[0].check())
    assert ended[0].startswith("jaxtrain: process 1 of 3 is stuck:")
    assert ended[0].endswith(
        "Exiting with code 5; start every process again with the same command to resume."
    )


def test_only_a_process_behind_while_stepping_is_stuck():
    board = ProgressBoard(2, 5.0, now=0.0)
    board.advance(0, 0, "step", now=0.0)
    assert board.stuck(100.0) == []  # process 1 is still starting up (compiling)
    board.see(1, Position(1, 0, "step"), now=1.0)
    board.advance(0, 1, "step", now=2.0)  # process 0 dispatched step 1 and waits for 1
    assert board.stuck(5.9) == []
    assert board.stuck(6.0) == [Stuck(1, Position(1, 0, "step"), 5.0)]
    # Both evaluate (a hook) for as long as it takes; the watch waits.
    board.see(1, Position(3, 1, "hook"), now=7.0)
    board.advance(0, 1, "hook", now=7.0)
    assert board.stuck(60.0) == []
    # Process 0 is saving and waits for process 1, which stands before its save.
    board.see(1, Position(2, 1, "step"), now=61.0)
    assert board.stuck(66.0) == [Stuck(1, Position(2, 1, "step"), 5.0)]
    board.see(1, Position(5, 1, "end"), now=67.0)  # a process that ended is not waited for
    assert board.stuck(80.0) == []
    assert Position.decode(Position(7, 3, "hook").encode()) == Position(7, 3, "hook")
    assert Position.decode("garbage") is None
    assert ProgressBoard(2, None, now=0.0).stuck(1e9) == []  # no step_timeout_s: off


class Unreachable:
    """A client whose service does not answer (its host is gone)."""

    def key_value_set(self, *args, **kwargs):
        raise ConnectionError("UNAVAILABLE")

    key_value_dir_get = key_value_set


def test_a_service_that_stops_answering_is_a_lost_cluster():
    clock = Clock()
    watch = PeerWatch(
        Unreachable(), 1, 2, 5.0, service="the coordination service (h:1)", clock=clock
    )
    clock.now = 3.9
    watch.beat()
    assert watch.check() is None
    clock.now = 4.0
    assert watch.check().startswith("lost the coordination service (h:1): no answer for 4.0s")


def test_the_coordination_service_process_ends_with_process_0():
    port = _free_port()
    options = dict(heartbeat_timeout_s=20, shutdown_timeout_s=30, start_timeout_s=30)
    service = start_coordinator(f"127.0.0.1:{port}", 2, grace_s=60, **options)
    try:
        # The port is taken: a second service says so instead of crashing its process.
        with pytest.raises(RuntimeError, match=f"could not listen on 127.0.0.1:{port}"):
            start_coordinator(f"127.0.0.1:{port}", 2, grace_s=1, **options)
        service.stdin.write("clean\n")
        service.stdin.close()  # process 0 ended normally: no grace period
        assert service.wait(timeout=10) == 0
    finally:
        service.kill()
    # Process 0 gone without a clean end: the service stays for its grace period.
    service = start_coordinator(f"127.0.0.1:{port}", 2, grace_s=1.5, **options)
    started = time.monotonic()
    service.stdin.close()
    assert service.wait(timeout=10) == 0
    assert time.monotonic() - started >= 1.5


def test_peer_and_step_timeouts_are_checked():
    assert TrainingArguments().peer_timeout_s == 30.0
    with pytest.raises(ArgumentError, match="peer_timeout_s must be >= 1"):
        TrainingArguments(peer_timeout_s=0.5)
    assert TrainingArguments().step_timeout_s is None  # the progress watch is off
    with pytest.raises(ArgumentError, match="step_timeout_s must be >= 1 .* or None"):
        TrainingArguments(step_timeout_s=0)
