"""The cluster's coordination service, in a small process of its own beside process 0.

Why not inside process 0, where `jax.distributed.initialize` puts it: every JAX client
long-polls the service for errors, and when that connection breaks (process 0 was killed)
the client ends its own process at once with a C++ fatal error (jaxlib's client.h,
"Terminating process because the JAX distributed service detected fatal errors"), before
any Python code of ours can run. jaxlib 0.10.2 takes a `missed_heartbeat_callback` for
that case, but calling a Python callable with the error status fails (std::bad_cast,
`terminate`), so the abort cannot be intercepted either. A service that outlives process 0
lets the survivors notice the loss themselves (parallel/peers.py) and end with one line.

Process 0 starts this file as a script (`start_coordinator`): it imports only the standard
library and jaxlib's extension (about 0.2 s, no jax), serves on the address JAX would have
used, says "ready" on stdout, then reads its stdin, a pipe from process 0:

- "clean" and then end of file: process 0 ended normally (after JAX's shutdown barrier,
  which every process passed): the service stops at once;
- end of file alone: process 0 died; the service stays `grace_s` more, long enough for
  the survivors' watchdogs to see process 0's heartbeat stop, then stops.

It runs in a session of its own, so a Ctrl-C in the terminal of process 0 does not end it
before process 0 is gone; nothing else ends it but the end of its stdin.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

READY = "ready"


def start_coordinator(
    bind_address: str,
    num_processes: int,
    *,
    heartbeat_timeout_s: int,
    shutdown_timeout_s: int,
    grace_s: float,
    start_timeout_s: float,
) -> subprocess.Popen:
    """Start the service process and wait (up to `start_timeout_s`) until it listens.

    The returned Popen must stay referenced for the life of the process: its stdin pipe is
    what tells the service that process 0 is alive. Raises RuntimeError when the service
    cannot start (typically the port is taken, e.g. by a previous run's service that is
    still within its grace period).
    """
    command = [
        sys.executable,
        "-I",  # isolated: no user site, not the script's folder first on sys.path
        str(Path(__file__).resolve()),
        bind_address,
        str(num_processes),
        str(heartbeat_timeout_s),
        str(shutdown_timeout_s),
        str(grace_s),
    ]
    proc = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # the service's own logs would interleave with the run's
        start_new_session=True,
        text=True,
    )
    ready, _, _ = select.select([proc.stdout], [], [], start_timeout_s)
    line = proc.stdout.readline().strip() if ready else ""
    if line == READY:
        return proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    raise RuntimeError(
        f"the coordination service could not listen on {bind_address} "
        f"({line or f'exit status {proc.returncode}'}); is the port in use, e.g. by the service "
        f"of a run that ended less than {grace_s:g}s ago?"
    )


def _check_port_free(bind_address: str) -> None:
    """OSError when something listens on the address's port already.

    gRPC servers share a port (SO_REUSEPORT): a second service on a taken port would start
    and receive a random half of the connections, some clients would join the wrong
    cluster. A plain socket does not share: its bind fails while anything listens there.
    SO_REUSEADDR lets it pass the closed connections of an earlier run (TIME_WAIT).
    """
    host, _, port = bind_address.rpartition(":")
    host = host.strip("[]") or "::"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, int(port), 0, socket.SOCK_STREAM
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise
        # Anything else (no IPv6 here, say) is for the service itself to report.


def _serve(
    bind_address: str, num_processes: int, heartbeat_s: int, shutdown_s: int, grace_s: float
) -> None:
    _check_port_free(bind_address)
    from jaxlib import _jax  # what jax.distributed.initialize itself calls on process 0

    service = _jax.get_distributed_runtime_service(
        bind_address,
        num_processes,
        heartbeat_timeout=heartbeat_s,
        shutdown_timeout=shutdown_s,
    )
    print(READY, flush=True)
    clean = False
    for line in sys.stdin:
        clean = clean or line.strip() == "clean"
    # A short pause even after a clean end: the last clients may still be reading the
    # answer to their shutdown call.
    time.sleep(1.0 if clean else grace_s)
    service.shutdown()


if __name__ == "__main__":
    bind, count, heartbeat, shutdown, grace = sys.argv[1:6]
    try:
        _serve(bind, int(count), int(heartbeat), int(shutdown), float(grace))
    except Exception as err:  # reported to process 0 on the line it waits for
        print(f"{type(err).__name__}: {err}".splitlines()[0], flush=True)
    os._exit(0)  # jaxlib's threads are not joined: nothing is left to do
