"""Multi-host start-up that fails fast and says who is missing.

`jax.distributed.initialize` waits inside C++ until every process has registered with the
coordinator. When one never comes it prints nothing until its `initialization_timeout`, then
aborts the process with a stack dump (DEADLINE_EXCEEDED on RegisterTask), and a signal in the
meantime cannot be handled, since Python runs its handlers between bytecodes only. So `initialize`
first lets the processes meet over a plain TCP connection to the coordinator's own port:

  process 0   listens on the port of --coordinator_address; every other process connects (retrying
              while the port is closed) and sends `hello <process_id> <num_processes>`;
  all there   process 0 answers `go` to each and closes the port; then every process calls
              jax.distributed.initialize, which now finds all of its peers at once;
  timeout     when not all N have arrived within `timeout_s`, process 0 answers `missing <ids>`,
              and every waiting process raises StartupError naming the processes that are not
              there (or, in a process that never reached process 0, that the coordinator cannot
              be reached);
  mistakes    two processes with one --process_id, or different --num_processes, are refused
              by process 0 at once, in every waiting process.

jax.distributed.initialize itself then runs in a helper thread with the same timeout, watched
by the main thread, which thus keeps handling SIGTERM/SIGINT: either one, or the timeout, ends
the process at once (`os._exit`: a thread blocked in that C++ call cannot be stopped or joined)
with one line on stderr and no stack dump; exit status 0 after a signal, 1 after the timeout.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import threading
import time

import jax

from neurips26_jax.train.errors import StartupError

_GRACE_S = 5.0       # how much longer than timeout_s a process waits for process 0's answer


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               timeout_s: float) -> None:
  """jax.distributed.initialize for process `process_id` of `num_processes`, after all of them
  have met at `coordinator_address` (HOST:PORT) within `timeout_s` seconds; StartupError naming
  the missing processes otherwise (see the module docstring)."""
  host, port = coordinator_address.rsplit(":", 1)
  meeting = _Meeting(coordinator_address, host, int(port), num_processes, process_id, timeout_s)
  meeting.run()
  _watched_jax_initialize(coordinator_address, num_processes, process_id, timeout_s)


class _Meeting:

  def __init__(self, address: str, host: str, port: int, n: int, process_id: int,
               timeout_s: float):
    self.address, self.host, self.port, self.n, self.id = address, host, port, n, process_id
    self.timeout_s = timeout_s
    self.deadline = time.monotonic() + timeout_s

  def run(self) -> None:
    if self.n == 1:
      return
    if self.id == 0:
      self._coordinate()
    else:
      self._join()

  def _missing(self, ids) -> StartupError:
    names = ", ".join(str(i) for i in ids)
    which = "process" if len(ids) == 1 else "processes"
    return StartupError(
        f"{which} {names} of --num_processes={self.n} did not reach the coordinator "
        f"{self.address} within --init_timeout_s={self.timeout_s:g} s: start the same command "
        f"with --process_id={names} on {'its host' if len(ids) == 1 else 'their hosts'}, or "
        "check that they can reach this address")

  # process 0 ---------------------------------------------------------------------------------

  def _listen(self) -> socket.socket:
    try:
      if socket.has_dualstack_ipv6():           # jax's service binds [::]:port the same way
        return socket.create_server(("::", self.port), family=socket.AF_INET6,
                                    dualstack_ipv6=True)
      return socket.create_server(("", self.port))
    except OSError as e:
      raise StartupError(f"--coordinator_address={self.address}: process 0 cannot listen on "
                         f"port {self.port} ({e.strerror or e}); expected a free port on this "
                         "host") from None

  def _coordinate(self) -> None:
    server = self._listen()
    joined: dict[int, socket.socket] = {}
    try:
      while len(joined) < self.n - 1:
        left = self.deadline - time.monotonic()
        if left <= 0:
          missing = sorted(set(range(1, self.n)) - joined.keys())
          self._tell(joined, "missing " + ",".join(map(str, missing)))
          raise self._missing(missing)
        readable, _, _ = select.select([server, *joined.values()], [], [], min(left, 0.5))
        for sock in readable:
          if sock is server:
            self._admit(server, joined)
          else:                        # a joined process closed its connection: it stopped
            joined = {i: s for i, s in joined.items() if s is not sock}
            sock.close()
      self._tell(joined, "go")
      for sock in joined.values():    # they close first, so no TIME_WAIT stays on the port
        sock.settimeout(2.0)
        try:
          sock.recv(1)
        except OSError:
          pass
    finally:
      for sock in joined.values():
        sock.close()
      server.close()

  def _admit(self, server: socket.socket, joined: dict) -> None:
    conn, _ = server.accept()
    conn.settimeout(5.0)
    try:
      words = _read_line(conn).split()
    except OSError:
      conn.close()
      return
    if len(words) != 3 or words[0] != "hello" or not all(w.isdigit() for w in words[1:]):
      conn.close()                     # not one of ours (a port scanner, a stale client)
      return
    their_id, their_n = int(words[1]), int(words[2])
    problem = ""
    if their_n != self.n:
      problem = (f"process {their_id} was started with --num_processes={their_n} and process 0 "
                 f"with --num_processes={self.n}: give every process the same value")
    elif not 0 < their_id < self.n:
      problem = f"a process was started with --process_id={their_id}: expected 1..{self.n - 1}"
    elif their_id in joined:
      problem = (f"two processes were started with --process_id={their_id}: give each process "
                 "its own id")
    if problem:
      self._tell({**joined, -1: conn}, "error " + problem)
      conn.close()
      raise StartupError(problem)
    joined[their_id] = conn

  @staticmethod
  def _tell(joined: dict, message: str) -> None:
    for sock in joined.values():
      try:
        sock.sendall(message.encode() + b"\n")
      except OSError:
        pass

  # processes 1..N-1 --------------------------------------------------------------------------

  def _join(self) -> None:
    sock = self._connect()
    with sock:
      sock.sendall(f"hello {self.id} {self.n}\n".encode())
      sock.settimeout(self.timeout_s + _GRACE_S)    # process 0 answers by its own deadline
      try:
        reply = _read_line(sock)
      except socket.timeout:
        raise StartupError(f"the coordinator {self.address} (process 0) accepted the connection "
                           f"but gave no answer within --init_timeout_s={self.timeout_s:g} s "
                           "(plus a few): it is stuck, or is not this program") from None
      except OSError as e:
        reply = f"closed ({e.strerror or e})"
    if reply == "go":
      return
    if reply.startswith("missing "):
      raise self._missing([int(i) for i in reply.split()[1].split(",")])
    if reply.startswith("error "):
      raise StartupError(reply[len("error "):])
    raise StartupError(f"the coordinator {self.address} (process 0) closed the connection before "
                       "all processes had arrived: it stopped or failed (see its output)")

  def _connect(self) -> socket.socket:
    while True:
      left = self.deadline - time.monotonic()
      try:
        return socket.create_connection((self.host, self.port), timeout=max(min(left, 2.0), 0.1))
      except OSError as e:
        if left <= 0:
          raise StartupError(
              f"process 0 (the coordinator) is not reachable at {self.address} within "
              f"--init_timeout_s={self.timeout_s:g} s ({e.strerror or e}): start it with "
              "--process_id=0 on that host, or check the address and that the port is "
              "open") from None
        time.sleep(min(0.5, max(left, 0.0)))


def _read_line(sock: socket.socket, limit: int = 256) -> str:
  """One \\n-terminated ASCII line (at most `limit` bytes) from `sock`; "" at EOF."""
  data = b""
  while not data.endswith(b"\n") and len(data) < limit:
    chunk = sock.recv(limit - len(data))
    if not chunk:
      break
    data += chunk
  return data.decode("ascii", errors="replace").strip()


def _watched_jax_initialize(address: str, n: int, process_id: int, timeout_s: float) -> None:
  """jax.distributed.initialize in a helper thread (its own timeout set past ours, so that it
  never aborts first); the main thread waits, handling signals and `timeout_s`."""
  outcome: list[BaseException | None] = []

  def target():
    try:
      jax.distributed.initialize(coordinator_address=address, num_processes=n,
                                 process_id=process_id,
                                 initialization_timeout=int(timeout_s) + 60)
      outcome.append(None)
    except BaseException as e:  # noqa: BLE001  (handed to the main thread)
      outcome.append(e)

  thread = threading.Thread(target=target, name="jax.distributed.initialize", daemon=True)
  thread.start()
  deadline = time.monotonic() + timeout_s
  try:
    while thread.is_alive() and time.monotonic() < deadline:
      thread.join(0.2)
  except KeyboardInterrupt:
    _exit_now("interrupted: stopped while connecting to the other processes; nothing was "
              "trained", 0)
  if thread.is_alive():
    _exit_now(f"error: jax.distributed.initialize did not finish within --init_timeout_s="
              f"{timeout_s:g} s although all {n} processes had reached the coordinator "
              f"{address}: one of them stopped since, or cannot reach it over gRPC", 1)
  if outcome and outcome[0] is not None:
    raise outcome[0]


def _exit_now(line: str, status: int) -> None:
  sys.stdout.flush()
  sys.stderr.write(line + "\n")
  sys.stderr.flush()
  os._exit(status)
