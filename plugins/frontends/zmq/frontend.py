"""Frontend ``zmq``: the job protocol (``tokenloom.protocols.jobs``) on a ROUTER socket.

Each connection (a client's DEALER) is one ``Session`` (see ``sessions.py``); its
jobs run as one task each, streaming ``JobOutput`` messages and a closing ``JobDone``,
or ending with one ``JobError``. Whatever a client sends, the loop keeps serving:
each message is handled under a catch-all, so a frame that cannot be decoded (deep
nesting included), a job over the limits or a bug in a handler gets a ``JobError``
reply and nothing else.

Authentication: when ``config.api_key`` is set, a connection must open with
``hello`` carrying that key (compared in constant time) before it may submit or
abort; ``ping`` stays open, like HTTP's ``/health``. We chose a key in the protocol
over ZeroMQ CURVE: it is the same credential and the same model as the HTTP API
(one ``--api-key`` guards both), it needs no key-pair distribution and no libsodium
build, and clients in any language can speak it. It does not encrypt: like the HTTP
API without TLS, expose the endpoint beyond loopback only through a tunnel or a
trusted network.

Heartbeat: every message counts. A connection with live jobs that sends nothing for
``config.zmq_heartbeat_timeout_s`` has its jobs ended with ``JobError`` 408 (the
Python clients ping in the background while they have live jobs). A connection that
drops loses its jobs at once (their engine requests are aborted).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from typing import Any, cast

import msgspec
import zmq
import zmq.asyncio

from tokenloom.config import EngineConfig
from tokenloom.logging import get_logger
from tokenloom.plugins.frontends.admission import Admission, Reservation
from tokenloom.plugins.frontends.generation import Generation, LiveGenerations
from tokenloom.plugins.frontends.limits import ModelLimits, PromptError, check_request_limits
from tokenloom.plugins.frontends.metrics import ServingMetrics
from tokenloom.plugins.frontends.zmq.sessions import Connections, Job, Session, source_fd
from tokenloom.protocols.components.engine import EngineClient
from tokenloom.protocols.components.errors import EngineDeadError, EngineError, QueueFullError
from tokenloom.protocols.components.frontend import Frontend
from tokenloom.protocols.control import Ready
from tokenloom.protocols.jobs import (
    AbortJob,
    HelloJob,
    JobDone,
    JobError,
    JobOutput,
    JobPong,
    JobRequest,
    JobWelcome,
    PingJob,
    SubmitJob,
)
from tokenloom.protocols.outputs import FinishReason
from tokenloom.protocols.sampling import InvalidParameter
from tokenloom.transport.sockets import make_socket

log = get_logger(__name__)

THREAD_TOKENIZE_CHARS = 16_384  # longer prompts are tokenized off the event loop


class _Head(msgspec.Struct, array_like=True):
    """The tag and job id of a message that failed validation (the rest is skipped)."""

    tag: str
    job_id: str


class ZmqFrontend(Frontend):
    name = "zmq"

    def __init__(
        self, config: EngineConfig, engine: EngineClient, tokenizer: Any, ready: Ready | None = None
    ) -> None:
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = ModelLimits.of(config, tokenizer, ready)
        # One admission count and one set of metrics for every frontend of the engine:
        # a job's sequences are refused at once when HTTP requests fill the queue, and
        # finished jobs show in /metrics.
        max_num_seqs = (ready.max_num_seqs if ready else 0) or config.max_num_seqs
        self.live = LiveGenerations(
            engine, tokenizer, self.limits.eos_token_ids, config.request_timeout_s,
            ServingMetrics.for_engine(engine),
            Admission.for_engine(engine, max_num_seqs + config.max_waiting_requests),
        )  # fmt: skip
        self.max_message_bytes = int(config.max_request_body_mb * (1 << 20))
        self.decoder = msgspec.msgpack.Decoder(JobRequest)
        self.head_decoder = msgspec.msgpack.Decoder(_Head)
        self.encoder = msgspec.msgpack.Encoder()
        self.handlers = {
            SubmitJob: self._on_submit,
            AbortJob: self._on_abort,
            PingJob: self._on_ping,
            HelloJob: self._on_hello,
        }
        self.open_messages = (PingJob, HelloJob)  # answered without a session key
        self.socket: zmq.asyncio.Socket | None = None
        self.connections: Connections | None = None

    async def serve(self) -> None:
        ctx = zmq.asyncio.Context()
        self.socket = sock = make_socket(
            ctx, "jobs", self.config.zmq_endpoint, bind=True,
            max_message_bytes=self.max_message_bytes,
        )  # fmt: skip
        sock.setsockopt(zmq.ROUTER_HANDOVER, 0)  # a live connection's routing id is its own
        self.connections = Connections(
            zmq.Socket.shadow(sock.underlying), zmq.Context.shadow(ctx.underlying),
            authenticated=not self.config.api_key,
        )  # fmt: skip
        log.info("zmq frontend: jobs at %s", self.endpoint)
        sweeper = asyncio.create_task(self._sweep_silent())
        try:
            while True:
                frames = await sock.recv_multipart(copy=False)
                try:
                    self._on_frames(frames)
                except Exception:  # the handlers answer their own errors; a last guard
                    log.exception("zmq frontend: message handling failed")
        except asyncio.CancelledError:
            await self.live.drain(self.config.shutdown_grace_s)
            raise
        finally:
            sweeper.cancel()
            tasks = [j.task for s in self.connections.sessions.values() for j in s.jobs.values()]
            for task in tasks:
                if task is not None:
                    task.cancel()
            await asyncio.gather(*(t for t in tasks if t is not None), return_exceptions=True)
            self.connections.close_all()
            sock.close(linger=0)
            ctx.term()

    @property
    def endpoint(self) -> str | None:
        """The bound endpoint (with the real port when configured with port 0)."""
        if self.socket is None:
            return None
        return self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    # ------------------------------------------------------------------ messages in

    def _on_frames(self, frames: list[Any]) -> None:
        assert self.connections is not None
        session = self.connections.session_of(frames[0].bytes, source_fd(frames[-1]))
        if session is None:
            return  # sent just before its connection dropped: nobody to answer
        if len(frames) != 2:
            self._send(session, JobError(None, 400, "a message is exactly one frame"))
            return
        try:
            self._dispatch(session, frames[1].buffer)
        except Exception as exc:
            log.exception("zmq frontend: handler failed")
            self._send(session, JobError(None, 500, f"internal error: {type(exc).__name__}"))

    def _dispatch(self, session: Session, body: Any) -> None:
        if len(body) > self.max_message_bytes:
            reason = f"message of {len(body)} bytes over the limit of {self.max_message_bytes}"
            self._send(session, JobError(None, 413, reason))
            return
        try:
            msg = self.decoder.decode(body)
        except Exception as exc:  # ValidationError, DecodeError, RecursionError, ...
            job_id = self._salvage_job_id(body)
            self._send(session, JobError(job_id, 400, f"bad message: {_reason(exc)}"))
            return
        if not session.authenticated and not isinstance(msg, self.open_messages):
            job_id = getattr(msg, "job_id", None)
            self._send(session, JobError(job_id, 401, "send hello with the API key first"))
            return
        self.handlers[type(msg)](session, msg)

    def _on_hello(self, session: Session, msg: HelloJob) -> None:
        key = self.config.api_key
        session.authenticated = not key or hmac.compare_digest(
            (msg.api_key or "").encode(), key.encode()
        )
        if not session.authenticated:
            self._send(session, JobError(None, 401, "invalid API key"))
            return
        timeout_s = self.config.zmq_heartbeat_timeout_s
        self._send(session, JobWelcome(timeout_s, self.max_message_bytes))

    def _on_submit(self, session: Session, submit: SubmitJob) -> None:
        job_id = submit.job_id
        if len(job_id.encode()) > self.config.max_request_id_bytes:
            reason = f"job_id: longer than {self.config.max_request_id_bytes} bytes"
            self._send(session, JobError(None, 400, reason))  # not echoed back
            return
        live = session.jobs.get(job_id)
        if live is not None and not live.ended:
            self._send(session, JobError(job_id, 409, "job id already in flight"))
            return
        try:
            self._check(submit)
        except ValueError as exc:  # PromptError, InvalidParameter
            self._send(session, JobError(job_id, 400, str(exc)))
            return
        job = session.jobs[job_id] = Job(job_id, submit.params.n)
        job.task = asyncio.create_task(self._run(session, job, submit))
        job.task.add_done_callback(lambda task: self._job_finished(session, job, task))

    def _on_abort(self, session: Session, msg: AbortJob) -> None:
        job = session.jobs.get(msg.job_id)
        if job is None or job.task is None or job.ended:
            self._send(session, JobError(msg.job_id, 404, "no such job in flight"))
            return
        job.task.cancel()

    def _on_ping(self, session: Session, msg: PingJob) -> None:
        self._send(session, JobPong(msg.nonce, self.engine.is_alive))

    def _check(self, submit: SubmitJob) -> None:
        """Refuse a job beyond the limits before any work is done for it."""
        if (submit.prompt is None) == (submit.prompt_token_ids is None):
            raise PromptError("set exactly one of prompt and prompt_token_ids", "prompt")
        check_request_limits(self.config, submit.params, priority=submit.priority)
        ids = submit.prompt_token_ids
        if ids is not None:
            if len(ids) >= self.limits.max_model_len:
                reason = f"{len(ids)} tokens, the model length is {self.limits.max_model_len}"
                raise PromptError(reason, "prompt_token_ids")
            self.limits.check_token_ids(ids, "prompt_token_ids")
        if self.limits.vocab_size:
            self.limits.check_token_ids(submit.params.stop_token_ids, "stop_token_ids")

    def _salvage_job_id(self, body: Any) -> str | None:
        """The job id of a message that failed validation, when it has a short one."""
        try:
            job_id = self.head_decoder.decode(body).job_id
        except Exception:  # anything at all: this only decorates an error reply
            return None
        return job_id if len(job_id.encode()) <= self.config.max_request_id_bytes else None

    # ------------------------------------------------------------------ jobs

    async def _run(self, session: Session, job: Job, submit: SubmitJob) -> None:
        """Run one job to its one terminal message (unless its connection is gone)."""
        generation: Generation | None = None
        finished: set[int] = set()
        try:
            generation = await self._start(session, submit)
            async for updates in generation.updates():
                for u in updates:
                    if u.finish_reason is not None:
                        finished.add(u.index)
                    msg = JobOutput(job.job_id, u.index, u.text, u.token_ids, u.finish_reason)
                    msg.logprobs = u.logprobs
                    self._send(session, msg)
        except asyncio.CancelledError:  # aborted, timed out, connection gone, or shutdown
            if job.ended:
                return
            if job.timed_out:
                reason = f"no message for {self.config.zmq_heartbeat_timeout_s} s"
                self._end(session, job, JobError(job.job_id, 408, reason))
                return
            for index in range(job.n):
                if index not in finished:
                    self._send(session, JobOutput(job.job_id, index, "", [], FinishReason.ABORT))
        except (PromptError, InvalidParameter) as exc:
            self._end(session, job, JobError(job.job_id, 400, str(exc)))
            return
        except QueueFullError as exc:
            self._end(session, job, JobError(job.job_id, 503, f"overloaded: {exc}"))
            return
        except EngineDeadError:
            self._end(session, job, JobError(job.job_id, 503, "the engine is not running"))
            return
        except EngineError as exc:
            self._end(session, job, JobError(job.job_id, exc.code, exc.message))
            return
        except Exception as exc:
            log.exception("job %s failed", job.job_id)
            self._end(session, job, JobError(job.job_id, 500, f"internal error: {exc!r}"))
            return
        finally:
            if generation is not None:
                with contextlib.suppress(Exception):
                    await generation.close()
        prompt_tokens = generation.num_prompt_tokens if generation else 0
        generated = generation.num_generated_tokens if generation else 0
        metrics = generation.job_metrics() if generation and submit.include_metrics else None
        self._end(session, job, JobDone(job.job_id, prompt_tokens, generated, metrics))

    async def _start(self, session: Session, submit: SubmitJob) -> Generation:
        # Admission first: a full queue refuses before any tokenizing.
        reservation = self.live.reserve(submit.params.n)
        try:
            return await self._prepare(session, submit, reservation)
        except BaseException:
            if reservation is not None:
                reservation.release()
            raise

    async def _prepare(
        self, session: Session, submit: SubmitJob, reservation: Reservation | None
    ) -> Generation:
        if submit.prompt is not None:
            if len(submit.prompt) > THREAD_TOKENIZE_CHARS:
                ids = await asyncio.to_thread(self.tokenizer.encode, submit.prompt)
            else:
                ids = self.tokenizer.encode(submit.prompt)
        else:
            ids = list(submit.prompt_token_ids or [])
        max_tokens = self.limits.output_room(len(ids), submit.params.max_tokens)
        params = msgspec.structs.replace(submit.params, max_tokens=max_tokens)
        request_id = f"job-{session.serial}-{submit.job_id}"
        return self.live.new(
            request_id, submit.prompt, ids, params, submit.priority, reservation=reservation,
            tenant=submit.tenant, metadata=submit.metadata,
        )  # fmt: skip

    def _job_finished(self, session: Session, job: Job, task: asyncio.Task[None]) -> None:
        """Forget the job; end it if its task never ran (cancelled before it started)."""
        if session.jobs.get(job.job_id) is job:
            del session.jobs[job.job_id]
        if job.ended:
            return
        if task.cancelled() and not job.timed_out:
            for index in range(job.n):
                self._send(session, JobOutput(job.job_id, index, "", [], FinishReason.ABORT))
            self._end(session, job, JobDone(job.job_id))
        elif task.cancelled():
            reason = f"no message for {self.config.zmq_heartbeat_timeout_s} s"
            self._end(session, job, JobError(job.job_id, 408, reason))
        else:
            self._end(session, job, JobError(job.job_id, 500, "internal error"))

    async def _sweep_silent(self) -> None:
        """End the jobs of connections silent for longer than the heartbeat timeout."""
        assert self.connections is not None
        timeout_s = self.config.zmq_heartbeat_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout_s / 4))
            for session in self.connections.silent(timeout_s):
                log.info("zmq client silent for %.1f s: ending its jobs", timeout_s)
                for job in session.jobs.values():
                    job.timed_out = True
                    if job.task is not None:
                        job.task.cancel()

    # ------------------------------------------------------------------ messages out

    def _end(self, session: Session, job: Job, msg: JobDone | JobError) -> None:
        """Send a job's terminal message, once."""
        if not job.ended:
            job.ended = True
            self._send(session, msg)

    def _send(self, session: Session, msg: Any) -> None:
        assert self.socket is not None and self.connections is not None
        if not self.connections.is_open(session):
            return  # its connection is gone: never to whoever holds the routing id now
        # HWM 0: a ROUTER send never blocks; a gone client's messages are dropped. It goes
        # through the asyncio socket, never a synchronous shadow of it: a send processes
        # the socket's pending commands, which can make a message readable while
        # consuming the edge of the (edge-triggered) descriptor that the receive loop
        # waits on; pyzmq's own send re-checks for that and wakes the receiver, a
        # shadow's does not, and the message (a new connection's hello, say) then waits
        # until some other connection happens to wake the loop (issue 15's lost hello).
        frames = [session.identity, self.encoder.encode(msg)]
        sent = cast("asyncio.Future[Any]", self.socket.send_multipart(frames, zmq.NOBLOCK))
        if sent.done() and not sent.cancelled():
            sent.exception()  # retrieved (a ZMQError is dropped, like a gone client's)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc)[:500]
