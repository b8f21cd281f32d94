"""The zmq frontend's clients: one ``Session`` per ZeroMQ connection, and its jobs.

A job belongs to the connection that submitted it. A ROUTER socket names a peer only
by its routing id, and a DEALER may choose its own (``ZMQ_IDENTITY``): a second
connection that reuses a live connection's id is ignored by libzmq (ROUTER_HANDOVER
stays off), but once the first connection drops, a newcomer with the same id would be
routed whatever the server sends to that id. So ``Connections`` binds each session to
the file descriptor its messages arrive on (``ZMQ_SRCFD``) and watches the socket
monitor's DISCONNECTED events (which carry that descriptor):

- a connection that drops ends its session: its jobs are cancelled silently (nothing
  is sent to its routing id again) and their engine requests are aborted;
- a message under a known routing id from another descriptor means a new connection
  took the id over: the old session ends the same way, and the newcomer starts a fresh
  session, unauthenticated and owning no jobs.

libzmq posts a DISCONNECTED event before it frees the routing id, so checking the
monitor just before each send (``is_open``) means a reply never reaches a connection
that took over the id (the check is a non-blocking poll of an inproc socket).
Transports without descriptors (inproc) fall back to the routing id alone.
"""

from __future__ import annotations

import asyncio
import itertools
import time
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
    serial: int  # unique per frontend: engine request ids of its jobs embed it
    authenticated: bool
    last_seen: float  # time.monotonic() of its last message
    jobs: dict[str, Job] = field(default_factory=dict)
    closed: bool = False


class Connections:
    """Sessions by routing id and by descriptor. ``session_of`` on every message,
    ``is_open`` before every send, ``silent`` for the heartbeat sweep; ``close_all``
    at shutdown. Not thread-safe (the frontend's event loop only)."""

    def __init__(self, router: zmq.Socket, context: zmq.Context, *, authenticated: bool) -> None:
        self._authenticated = authenticated  # a new session's state: True without a key
        self._serials = itertools.count(1)
        self.sessions: dict[bytes, Session] = {}
        self._by_fd: dict[int, Session] = {}
        self._router = router
        address = f"inproc://tokenloom-jobs-monitor-{id(self):x}"
        router.monitor(address, zmq.EVENT_DISCONNECTED)
        self._monitor: zmq.Socket[bytes] = context.socket(zmq.PAIR)
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._monitor.connect(address)

    def session_of(self, identity: bytes, fd: int) -> Session:
        """The session of a message that arrived from ``identity`` on ``fd``, refreshed
        as alive (every message is a heartbeat); a new one for a new connection."""
        self.poll_disconnects()
        session = self.sessions.get(identity)
        if session is not None and session.fd != fd:
            self.close(session)  # another connection took this routing id over
            session = None
        if session is None:
            session = Session(
                identity, fd, next(self._serials), self._authenticated, time.monotonic()
            )
            self.sessions[identity] = session
            if fd >= 0:
                self._by_fd[fd] = session
        session.last_seen = time.monotonic()
        return session

    def is_open(self, session: Session) -> bool:
        """Whether ``session``'s connection is still there (see the module docstring)."""
        if not session.closed:
            self.poll_disconnects()
        return not session.closed

    def poll_disconnects(self) -> None:
        """Close the sessions of connections the monitor reports gone; never blocks."""
        while int(self._monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            event = parse_monitor_message(self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                session = self._by_fd.get(int(event["value"]))
                if session is not None:
                    self.close(session)

    def close(self, session: Session) -> None:
        """End ``session``: cancel its jobs silently and forget it. Idempotent."""
        if session.closed:
            return
        session.closed = True
        if self.sessions.get(session.identity) is session:
            del self.sessions[session.identity]
        if self._by_fd.get(session.fd) is session:
            del self._by_fd[session.fd]
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
