"""The zmq frontend's clients: one ``Session`` per ZeroMQ connection, and its jobs.

A job belongs to the connection that submitted it. A ROUTER socket names a peer only
by its routing id, and a DEALER may choose its own (``ZMQ_IDENTITY``, even one shaped
like the ids libzmq generates): a second connection that reuses a live connection's id
is ignored by libzmq (ROUTER_HANDOVER stays off), but once the first connection drops,
a newcomer with the same id would be routed whatever the server sends to that id. So
``Connections`` ties each session to the connection its messages arrive on: the file
descriptor (``ZMQ_SRCFD``) and which connection on that descriptor it is, counted from
the socket monitor's ACCEPTED and DISCONNECTED events (both carry the descriptor):

- on one descriptor, connections come and go in turn (libzmq posts DISCONNECTED before
  it closes a descriptor, ACCEPTED after it accepts one), so the k-th DISCONNECTED on a
  descriptor ends exactly its k-th connection, never a later one that reuses the number;
- a connection that drops ends its session: its jobs are cancelled silently (nothing
  is sent to its routing id again) and their engine requests are aborted;
- messages a connection sent just before it dropped can be read after its DISCONNECTED:
  they are dropped (a tombstone remembers the gone connection), never the start of a
  new session whose jobs would run for nobody;
- a message under a known routing id from another connection means a new connection
  took the id over: the old session ends the same way, and the newcomer starts a fresh
  session, unauthenticated and owning no jobs.

One case stays ambiguous: a connection that dropped before any of its messages was
read, whose last words are read only after a newer connection on its descriptor was
accepted but before that one spoke, takes the newer connection's place, and the newer
one's first message is then dropped (it was never seen under churn tests; it needs the
server to lag a whole connection behind).

Checking the monitor just before each send (``is_open``, a non-blocking poll of an
inproc socket) means a reply never reaches a connection that took over the id.
Transports without descriptors (inproc) fall back to the routing id alone.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import parse_monitor_message


@dataclass(eq=False)
class Job:
    """One submitted job: its task runs it; ``ended`` once its last message is out (or
    its connection is gone); ``timed_out`` when the heartbeat sweep cancelled it."""

    job_id: str
    n: int
    task: asyncio.Task[None] | None = None
    ended: bool = False
    timed_out: bool = False


@dataclass(eq=False)
class Session:
    identity: bytes  # the connection's routing id
    fd: int  # the connection's descriptor; -1: unknown (inproc)
    ordinal: int  # which connection on ``fd`` (1 = the first accepted on it)
    serial: int  # unique per frontend: engine request ids of its jobs embed it
    authenticated: bool
    last_seen: float  # time.monotonic() of its last message
    jobs: dict[str, Job] = field(default_factory=dict)
    closed: bool = False


ACCEPT_WAIT_S = 0.005  # how long a first message waits for its connection's ACCEPTED
MAX_TOMBSTONES = 4096
TOMBSTONE_S = 0.5  # a client-chosen routing id back on the same fd: late words until then


class Connections:
    """Sessions by routing id and by descriptor. ``session_of`` on every message,
    ``is_open`` before every send, ``silent`` for the heartbeat sweep; ``close_all``
    at shutdown. Not thread-safe (the frontend's event loop only)."""

    def __init__(self, router: zmq.Socket, context: zmq.Context, *, authenticated: bool) -> None:
        self._authenticated = authenticated  # a new session's state: True without a key
        self._serials = itertools.count(1)
        self.sessions: dict[bytes, Session] = {}
        self._by_fd: dict[int, Session] = {}  # the session of the newest connection on an fd
        self._accepted: defaultdict[int, int] = defaultdict(int)  # fd -> connections so far
        self._gone: defaultdict[int, int] = defaultdict(int)  # fd -> of them, dropped
        self._tombstones: OrderedDict[bytes, tuple[int, int, float]] = OrderedDict()
        self.dropped_late = 0  # messages read after their connection dropped
        self._router = router
        address = f"inproc://tokenloom-jobs-monitor-{id(self):x}"
        router.monitor(address, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._monitor: zmq.Socket[bytes] = context.socket(zmq.PAIR)
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._monitor.connect(address)

    def session_of(self, identity: bytes, fd: int) -> Session | None:
        """The session of a message that arrived from ``identity`` on ``fd``, refreshed
        as alive (every message is a heartbeat); a new one for a new connection; None
        for a message its connection sent just before it dropped (drop it)."""
        self.poll_disconnects()
        session = self.sessions.get(identity)
        if session is not None:
            if session.fd == fd:
                session.last_seen = time.monotonic()
                return session
            self.close(session)  # another connection took this routing id over
        ordinal = self._new_connection(identity, fd)
        if ordinal is None:
            self.dropped_late += 1
            return None
        session = Session(
            identity, fd, ordinal, next(self._serials), self._authenticated, time.monotonic()
        )
        self.sessions[identity] = session
        if fd >= 0:
            self._by_fd[fd] = session
        return session

    def _new_connection(self, identity: bytes, fd: int) -> int | None:
        """Which connection on ``fd`` a routing id without a session speaks from: the
        newest one, unless that one is gone or has a session already, in which case
        the message is either a newcomer's whose ACCEPTED is not readable yet (wait a
        moment for it) or a gone connection's last words (None)."""
        if fd < 0:
            return 0
        if self._is_late(identity, fd):
            return None
        deadline = time.monotonic() + ACCEPT_WAIT_S
        while True:
            newest = self._accepted[fd]
            owner = self._by_fd.get(fd)
            if newest > self._gone[fd] and (owner is None or owner.ordinal < newest):
                if owner is not None:
                    self.close(owner)  # its descriptor is someone else's now
                return newest
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._monitor.poll(max(1, int(remaining * 1000))):
                return None
            self.poll_disconnects()

    def _is_late(self, identity: bytes, fd: int) -> bool:
        """Whether a message under a gone session's routing id, on the same descriptor,
        is that connection's last words (read after its DISCONNECTED). Yes while no
        newer connection on the descriptor was accepted. Otherwise it may be a new
        connection that chose the same id (and got the same descriptor): libzmq's ids
        (a zero byte first) are never reused, so those stay late words; a client's own
        id starts a new session once ``TOMBSTONE_S`` has passed."""
        tomb = self._tombstones.get(identity)
        if tomb is None or tomb[0] != fd:
            return False
        if self._accepted[fd] == tomb[1] or identity[:1] == b"\x00":
            return True
        return time.monotonic() - tomb[2] < TOMBSTONE_S

    def is_open(self, session: Session) -> bool:
        """Whether ``session``'s connection is still there (see the module docstring)."""
        if not session.closed:
            self.poll_disconnects()
        return not session.closed

    def poll_disconnects(self) -> None:
        """Read the monitor's events, closing the sessions of connections gone; never
        blocks."""
        while int(self._monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            event = parse_monitor_message(self._monitor.recv_multipart())
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._accepted[fd] += 1
                continue
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            self._gone[fd] += 1
            session = self._by_fd.get(fd)
            if session is not None and session.ordinal <= self._gone[fd]:
                self.close(session)  # (an earlier connection's event ends nothing)

    def close(self, session: Session) -> None:
        """End ``session``: cancel its jobs silently and forget it. Idempotent."""
        if session.closed:
            return
        session.closed = True
        if self.sessions.get(session.identity) is session:
            del self.sessions[session.identity]
        if self._by_fd.get(session.fd) is session:
            del self._by_fd[session.fd]
        if session.fd >= 0:
            self._tombstones[session.identity] = (session.fd, session.ordinal, time.monotonic())
            self._tombstones.move_to_end(session.identity)
            if len(self._tombstones) > MAX_TOMBSTONES:
                self._tombstones.popitem(last=False)
        for job in session.jobs.values():
            job.ended = True  # nothing more goes to this routing id
            if job.task is not None:
                job.task.cancel()

    def silent(self, timeout_s: float) -> list[Session]:
        """Sessions with live jobs that sent nothing for ``timeout_s`` seconds."""
        self.poll_disconnects()
        cutoff = time.monotonic() - timeout_s
        return [s for s in self.sessions.values() if s.jobs and s.last_seen < cutoff]

    def close_all(self) -> None:
        for session in list(self.sessions.values()):
            self.close(session)
        self._router.disable_monitor()
        self._monitor.close(linger=0)


def source_fd(frame: zmq.Frame) -> int:
    """The descriptor a received frame came in on; -1 where the transport has none."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError):
        return -1
