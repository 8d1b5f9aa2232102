"""The peer watch's decisions and the coordination service process, in this process.

A real coordination service and real JAX distributed-runtime clients (jaxlib's, the ones
`jax.distributed.initialize` makes) serve the watches' key-value store; time is a clock the
test moves. The end-to-end behaviour with killed and stopped processes is in
test_peer_loss.py.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from jaxtrain import TrainingArguments
from jaxtrain.checkpointing import committed_steps
from jaxtrain.errors import ArgumentError
from jaxtrain.parallel.coordinator import start_coordinator
from jaxtrain.parallel.peers import PeerWatch


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


def test_peer_timeout_is_checked():
    assert TrainingArguments().peer_timeout_s == 30.0
    with pytest.raises(ArgumentError, match="peer_timeout_s must be >= 1"):
        TrainingArguments(peer_timeout_s=0.5)
