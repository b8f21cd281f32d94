"""Frontend ``zmq``: the job protocol (``tokenloom.protocols.jobs``) on a ROUTER socket.

Each client (a DEALER) is known by its ZeroMQ identity; its jobs run as one task
each, streaming ``JobOutput`` messages and a closing ``JobDone``. A message that
cannot be decoded, a duplicate job id or a prompt that cannot fit gets a
``JobError`` reply; nothing a client sends can stop the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tokenloom.config import EngineConfig
from tokenloom.engine_client import EngineDeadError, EngineError
from tokenloom.logging import get_logger
from tokenloom.plugins.frontends.generation import Generation, LiveGenerations
from tokenloom.plugins.frontends.limits import ModelLimits
from tokenloom.protocols.components import EngineClient, Frontend
from tokenloom.protocols.control import Ready
from tokenloom.protocols.jobs import (
    MAX_JOB_MESSAGE_BYTES,
    AbortJob,
    JobDone,
    JobError,
    JobOutput,
    JobPong,
    JobRequest,
    PingJob,
    SubmitJob,
)
from tokenloom.protocols.outputs import FinishReason
from tokenloom.sockets import make_socket

log = get_logger(__name__)

JobKey = tuple[bytes, str]  # (client identity, job id)


class ZmqFrontend(Frontend):
    name = "zmq"

    def __init__(
        self, config: EngineConfig, engine: EngineClient, tokenizer: Any, ready: Ready | None = None
    ) -> None:
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = ModelLimits.of(config, tokenizer, ready)
        self.live = LiveGenerations(
            engine, tokenizer, self.limits.eos_token_ids, config.request_timeout_s
        )
        self.jobs: dict[JobKey, asyncio.Task[None]] = {}
        self.decoder = msgspec.msgpack.Decoder(JobRequest)
        self.encoder = msgspec.msgpack.Encoder()
        self.handlers = {
            SubmitJob: self._on_submit,
            AbortJob: self._on_abort,
            PingJob: self._on_ping,
        }
        self.socket: zmq.asyncio.Socket | None = None
        self._sender: zmq.Socket | None = None  # sync view of the same socket: sends never wait

    async def serve(self) -> None:
        ctx = zmq.asyncio.Context()
        self.socket = sock = make_socket(ctx, "jobs", self.config.zmq_endpoint, bind=True)
        self._sender = zmq.Socket.shadow(sock.underlying)
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("zmq frontend: jobs at %s", endpoint)
        try:
            while True:
                frames = await sock.recv_multipart(copy=False)
                self._dispatch(frames[0].bytes, frames[-1].buffer if len(frames) > 1 else b"")
        except asyncio.CancelledError:
            await self.live.drain(self.config.shutdown_grace_s)
            raise
        finally:
            for task in list(self.jobs.values()):
                task.cancel()
            await asyncio.gather(*self.jobs.values(), return_exceptions=True)
            sock.close(linger=0)
            ctx.term()

    @property
    def endpoint(self) -> str | None:
        """The bound endpoint (with the real port when configured with port 0)."""
        if self.socket is None:
            return None
        return self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    # ------------------------------------------------------------------ messages in

    def _dispatch(self, identity: bytes, body: Any) -> None:
        if len(body) > MAX_JOB_MESSAGE_BYTES:
            self._send(identity, JobError(None, 413, f"message over {MAX_JOB_MESSAGE_BYTES} bytes"))
            return
        try:
            msg = self.decoder.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self._send(identity, JobError(_salvage_job_id(body), 400, f"bad message: {exc}"))
            return
        self.handlers[type(msg)](identity, msg)

    def _on_submit(self, identity: bytes, job: SubmitJob) -> None:
        key = (identity, job.job_id)
        if key in self.jobs:
            self._send(identity, JobError(job.job_id, 409, "job id already in flight"))
            return
        try:
            generation = self._generation(identity, job)
        except ValueError as exc:
            self._send(identity, JobError(job.job_id, 400, str(exc)))
            return
        self.jobs[key] = asyncio.create_task(self._run(key, generation, job.params.n))

    def _on_abort(self, identity: bytes, msg: AbortJob) -> None:
        task = self.jobs.get((identity, msg.job_id))
        if task is None:
            self._send(identity, JobError(msg.job_id, 404, "no such job in flight"))
            return
        task.cancel()

    def _on_ping(self, identity: bytes, msg: PingJob) -> None:
        self._send(identity, JobPong(msg.nonce, self.engine.is_alive))

    def _generation(self, identity: bytes, job: SubmitJob) -> Generation:
        if (job.prompt is None) == (job.prompt_token_ids is None):
            raise ValueError("set exactly one of prompt and prompt_token_ids")
        if job.prompt is not None:
            ids = self.tokenizer.encode(job.prompt)
        else:
            ids = list(job.prompt_token_ids or [])
            self.limits.check_token_ids(ids, "prompt_token_ids")
        max_tokens = self.limits.output_room(len(ids), job.params.max_tokens)
        params = msgspec.structs.replace(job.params, max_tokens=max_tokens)
        request_id = f"job-{identity.hex()}-{job.job_id}"
        return self.live.new(request_id, job.prompt, ids, params, job.priority)

    # ------------------------------------------------------------------ messages out

    async def _run(self, key: JobKey, generation: Generation, n: int) -> None:
        identity, job_id = key
        finished: set[int] = set()
        try:
            async for updates in generation.updates():
                for u in updates:
                    if u.finish_reason is not None:
                        finished.add(u.index)
                    msg = JobOutput(job_id, u.index, u.text, u.token_ids, u.finish_reason)
                    msg.logprobs = u.logprobs
                    self._send(identity, msg)
        except asyncio.CancelledError:  # aborted by the client, or the server stops
            for index in range(n):
                if index not in finished:
                    self._send(identity, JobOutput(job_id, index, "", [], FinishReason.ABORT))
        except EngineDeadError:
            self._send(identity, JobError(job_id, 503, "the engine is not running"))
            return
        except EngineError as exc:
            self._send(identity, JobError(job_id, exc.code, exc.message))
            return
        except Exception as exc:
            log.exception("job %s failed", job_id)
            self._send(identity, JobError(job_id, 500, f"internal error: {exc!r}"))
            return
        finally:
            self.jobs.pop(key, None)
            with contextlib.suppress(Exception):
                await generation.close()
        self._send(
            identity, JobDone(job_id, generation.num_prompt_tokens, generation.num_generated_tokens)
        )

    def _send(self, identity: bytes, msg: Any) -> None:
        assert self._sender is not None
        # HWM 0: a ROUTER send never blocks; a gone client's messages are dropped.
        with contextlib.suppress(zmq.ZMQError):
            self._sender.send_multipart([identity, self.encoder.encode(msg)], zmq.NOBLOCK)


def _salvage_job_id(body: Any) -> str | None:
    """The job id of a message that failed validation, when it has one."""
    try:
        raw = msgspec.msgpack.decode(body)
    except msgspec.DecodeError:
        return None
    if isinstance(raw, list) and len(raw) > 1 and isinstance(raw[1], str):
        return raw[1]
    return None
