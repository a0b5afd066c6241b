"""Measuring on a fleet: TVM's RPC tracker, servers registered under a device key, a runner that
uses every server under the key.

What TVM gives as is and what we add:

* The tracker client retries a refused connection for a minute and waits on a silent socket for
  ever, so a tracker that is down (or a key with no servers) looked like a hang. :func:`check_fleet`
  asks the tracker with a socket timeout *before* any work starts and fails in one line.
* Meta-Schedule's ``RPCRunner`` measures one candidate at a time by default and waits on a session
  without a time limit. :class:`FleetRunner` runs the same measurement function
  (``rpc_runner._worker_func``: session from the tracker, upload, random inputs, time_evaluator)
  with one worker per server under the key, a time limit per candidate, and one retry through the
  tracker, which hands out another free server when one has died. A candidate whose retry fails
  too is a failed trial, as Meta-Schedule records any failed measurement.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tvm import rpc
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.runner import rpc_runner
from tvm.support.popen_pool import PopenPoolExecutor

from ..errors import TargetError

CONNECT_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class Tracker:
    """``host:port:key``: where the tracker is, and which servers (device key) to measure on."""

    host: str
    port: int
    key: str

    def __str__(self) -> str:
        return f"{self.host}:{self.port}:{self.key}"

    def config(self, session_timeout_s: float) -> ms.runner.RPCConfig:
        return ms.runner.RPCConfig(
            tracker_host=self.host,
            tracker_port=self.port,
            tracker_key=self.key,
            session_timeout_sec=int(max(session_timeout_s, 1)),
        )


def parse_rpc(spec: str) -> Tracker:
    """``"host:port:key"`` -> :class:`Tracker`."""
    parts = spec.rsplit(":", 2) if isinstance(spec, str) else []
    if len(parts) != 3 or not parts[0] or not parts[2] or not parts[1].isdigit():
        raise TargetError(f"bad RPC tracker {spec!r}: expected 'host:port:key', e.g. '127.0.0.1:9190:h100'")
    return Tracker(parts[0], int(parts[1]), parts[2])


@contextlib.contextmanager
def _socket_timeout(seconds: float):
    """Sockets created inside get a timeout (the tracker client sets none)."""
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(previous)


def tracker_summary(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> dict:
    """The tracker's summary (``server_info``, ``queue_info``), or a TargetError within seconds."""
    where = f"{host}:{port}"
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as err:
        raise TargetError(
            f"no RPC tracker at {where} ({err.strerror or err}): start one with "
            f"`python -m tvm.exec.rpc_tracker --host {host} --port {port}`"
        ) from None
    try:
        with _socket_timeout(timeout_s):
            session = rpc.connect_tracker(host, port)
            try:
                return session.summary()
            finally:
                session.close()
    except (OSError, RuntimeError) as err:
        raise TargetError(f"{where} does not answer as a TVM RPC tracker ({err})") from None


def servers_by_key(summary: dict) -> dict[str, int]:
    """How many servers the tracker has under each device key."""
    counts: dict[str, int] = {}
    for item in summary.get("server_info", []):
        key = str(item["key"]).split(":", 1)[-1]  # 'server:h100' -> 'h100'
        counts[key] = counts.get(key, 0) + 1
    return counts


def check_fleet(tracker: Tracker, timeout_s: float = CONNECT_TIMEOUT_S) -> int:
    """Number of servers under ``tracker.key``; a TargetError (within seconds) if there are none."""
    counts = servers_by_key(tracker_summary(tracker.host, tracker.port, timeout_s))
    if not counts.get(tracker.key):
        others = ", ".join(f"{k} ({n})" for k, n in sorted(counts.items())) or "none"
        raise TargetError(
            f"the RPC tracker at {tracker.host}:{tracker.port} has no server under key {tracker.key!r} "
            f"(keys with servers: {others}); start one with `python -m tvm.exec.rpc_server "
            f"--tracker {tracker.host}:{tracker.port} --key {tracker.key}`"
        )
    return counts[tracker.key]


def fleet_report(host: str, port: int) -> str:
    """A table of the tracker's servers per device key (for ``tvm-fusion fleet``)."""
    summary = tracker_summary(host, port)
    counts = servers_by_key(summary)
    queues = summary.get("queue_info", {})
    lines = [f"RPC tracker {host}:{port}", f"{'key':<20} {'servers':>7} {'free':>5} {'pending':>8}"]
    for key in sorted(set(counts) | set(queues)):
        queue = queues.get(key, {})
        lines.append(
            f"{key:<20} {counts.get(key, 0):>7} {queue.get('free', 0):>5} {queue.get('pending', 0):>8}"
        )
    if len(lines) == 2:
        lines.append("(no servers registered)")
    return "\n".join(lines)


@derived_object
class _RetryingFuture(ms.runner.PyRunnerFuture):
    def __init__(self, pool: PopenPoolExecutor, args: tuple, retries: int, timeout_s: float):
        super().__init__()
        self.pool, self.args, self.retries, self.timeout_s = pool, args, retries, timeout_s
        self.future = pool.submit(rpc_runner._worker_func, *args)

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> ms.runner.RunnerResult:
        while True:
            try:
                return ms.runner.RunnerResult([float(x) for x in self.future.result()], None)
            except (TimeoutError, concurrent.futures.TimeoutError):
                error = f"measurement timed out after {self.timeout_s:.0f} s"
            except Exception as err:  # a server that died, a lost session, a kernel that failed
                error = (
                    f"measurement failed: {str(err).strip().splitlines()[-1] if str(err).strip() else err}"
                )
            if self.retries <= 0:
                return ms.runner.RunnerResult(None, error)
            self.retries -= 1
            self.future = self.pool.submit(rpc_runner._worker_func, *self.args)


@derived_object
class FleetRunner(ms.runner.PyRunner):
    """Measures candidates on the servers under one tracker key, one worker per server."""

    def __init__(
        self, tracker: Tracker, evaluator_config, num_servers: int, timeout_s: float, retries: int = 1
    ):
        super().__init__()
        self.config = tracker.config(timeout_s)
        self.evaluator_config = ms.runner.EvaluatorConfig._normalized(evaluator_config)
        self.timeout_s = timeout_s
        self.retries = retries
        self.pool = PopenPoolExecutor(max_workers=max(1, num_servers), timeout=timeout_s)

    def run(self, runner_inputs):
        return [
            _RetryingFuture(
                self.pool,
                (
                    None,
                    None,
                    None,
                    None,
                    None,
                    self.config,
                    self.evaluator_config,
                    1,
                    str(ri.artifact_path),
                    str(ri.device_type),
                    tuple(arg.as_json() for arg in ri.args_info),
                ),
                self.retries,
                self.timeout_s,
            )
            for ri in runner_inputs
        ]


class LocalFleet:
    """A tracker and ``num_servers`` servers under ``key`` on 127.0.0.1, for trying the fleet path
    on one machine (tests, the fleet benchmark). A context manager: everything it started is
    stopped on exit. Server logs are ``<log_dir>/server<i>.log``."""

    def __init__(self, key: str, num_servers: int, log_dir: str | os.PathLike, timeout_s: float = 60.0):
        self.key, self.num_servers, self.timeout_s = key, num_servers, timeout_s
        self.log_dir = Path(log_dir)
        self.port = _free_port()
        self.tracker = Tracker("127.0.0.1", self.port, key)
        self.servers: list[subprocess.Popen] = []
        self._tracker_proc: subprocess.Popen | None = None
        self._logs: list = []

    def _spawn(self, args: list[str], log: str) -> subprocess.Popen:
        out = open(self.log_dir / log, "w")
        self._logs.append(out)
        # its own process group: an RPC server runs its sessions in worker processes, which must
        # stop with it (killing the server alone left them behind)
        return subprocess.Popen(
            [sys.executable, "-m", *args], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )

    @staticmethod
    def stop(proc: subprocess.Popen) -> None:
        """Kill a process this fleet started, with the workers it started (also when the process
        itself is already gone: its workers may not be)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def add_server(self) -> subprocess.Popen:
        port = _free_port()
        proc = self._spawn(
            [
                "tvm.exec.rpc_server",
                "--tracker",
                f"127.0.0.1:{self.port}",
                "--key",
                self.key,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--port-end",
                str(port + 1),
            ],
            f"server{len(self.servers)}.log",
        )
        self.servers.append(proc)
        return proc

    def server_log(self, index: int) -> str:
        return (self.log_dir / f"server{index}.log").read_text()

    def __enter__(self) -> LocalFleet:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._tracker_proc = self._spawn(
            [
                "tvm.exec.rpc_tracker",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--port-end",
                str(self.port + 1),
            ],
            "tracker.log",
        )
        try:
            for _ in range(self.num_servers):
                self.add_server()
            deadline = time.monotonic() + self.timeout_s
            while True:
                try:
                    if (
                        servers_by_key(tracker_summary("127.0.0.1", self.port, 2.0)).get(self.key)
                        == self.num_servers
                    ):
                        return self
                except TargetError:
                    pass
                if time.monotonic() > deadline:
                    raise TargetError(
                        f"local fleet did not come up in {self.timeout_s:.0f} s (logs in {self.log_dir})"
                    )
                time.sleep(0.5)
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *_exc) -> None:
        for proc in [*self.servers, self._tracker_proc]:
            if proc is not None:
                self.stop(proc)
        for log in self._logs:
            log.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
