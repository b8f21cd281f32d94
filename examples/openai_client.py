"""Talk to `tokenloom serve` with the official OpenAI client.

Start a server first (no MODEL_DIR: the built-in tiny default model):

    tokenloom serve --port 8000

then run `python examples/openai_client.py [--base-url http://127.0.0.1:8000/v1]`.
"""

from __future__ import annotations

import argparse

import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="unused", help="the server's --api-key, if set")
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    model = client.models.list().data[0].id
    print(f"model: {model}")

    # A plain completion, greedy, with usage.
    completion = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=16, temperature=0
    )
    print("completion:", repr(completion.choices[0].text), completion.usage)

    # A chat, streamed token by token, with usage in the last chunk.
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write a haiku about looms."}],
        max_tokens=32,
        temperature=0.8,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    print("chat: ", end="")
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        elif chunk.usage:
            print(f"\n({chunk.usage.completion_tokens} tokens)")

    # tokenloom's extra sampling parameters go in extra_body.
    extras = client.completions.create(
        model=model,
        prompt="1, 2, 3,",
        max_tokens=12,
        n=2,
        stop=["\n"],
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True},
    )
    for choice in extras.choices:
        print(f"choice {choice.index}: {choice.text!r} ({choice.finish_reason})")


if __name__ == "__main__":
    main()
