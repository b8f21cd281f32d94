"""Submit jobs over ZeroMQ with `tokenloom.client`, without HTTP.

Start a server with the zmq frontend enabled:

    tokenloom serve --frontends openai,zmq --zmq-endpoint tcp://127.0.0.1:5557

then run `python examples/zmq_client.py [--endpoint tcp://127.0.0.1:5557] [--api-key KEY]`
(the server's `api_key`, when it has one).
"""

from __future__ import annotations

import argparse
import asyncio

from tokenloom.client import AsyncJobClient, JobClient
from tokenloom.protocols.jobs import JobDone, JobOutput
from tokenloom.protocols.sampling import SamplingParams


def blocking(endpoint: str, api_key: str | None) -> None:
    with JobClient(endpoint, api_key=api_key) as client:
        print("engine alive:", client.ping())
        # One call: submit, wait, gather; tagged with a tenant and metadata, and with
        # the job's timings (JobMetrics) in the result.
        result = client.generate(
            "Once upon a time",
            SamplingParams(max_tokens=24, temperature=0),
            tenant="example",
            metadata={"source": "zmq_client.py"},
            include_metrics=True,
        )
        print("generate:", repr(result.text), result.finish_reasons)
        if result.metrics is not None:
            m = result.metrics
            print(f"  queue {m.queue_time:.3f} s, TTFT {m.time_to_first_token:.3f} s, "
                  f"total {m.e2e_time:.3f} s")  # fmt: skip
        # Streaming, then an abort of a long job.
        job = client.submit([1, 2, 3, 4], SamplingParams(max_tokens=500, ignore_eos=True))
        for message in client.stream(job):
            if isinstance(message, JobOutput):
                print(f"  +{message.token_ids} {message.text!r}")
                if message.finish_reason is None and len(message.token_ids):
                    client.abort(job)  # the stream ends with finish reason "abort"
            elif isinstance(message, JobDone):
                print(f"  done after {message.num_generated_tokens} tokens")


async def concurrent(endpoint: str, api_key: str | None) -> None:
    async with AsyncJobClient(endpoint, api_key=api_key) as client:
        prompts = [f"Story number {i}:" for i in range(4)]
        params = SamplingParams(max_tokens=16, temperature=0.7, seed=0)
        results = await asyncio.gather(*(client.generate(p, params) for p in prompts))
        for prompt, result in zip(prompts, results, strict=True):
            print(f"{prompt} {result.text!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:5557")
    parser.add_argument("--api-key", help="the server's api_key, if it has one")
    args = parser.parse_args()
    blocking(args.endpoint, args.api_key)
    asyncio.run(concurrent(args.endpoint, args.api_key))


if __name__ == "__main__":
    main()
