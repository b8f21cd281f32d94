"""Offline generation in your own process: ``LLM.generate`` and ``LLM.chat``.

    python examples/offline_generate.py [MODEL_DIR]

Without MODEL_DIR it writes a tiny random checkpoint (random weights, so the text
is gibberish; point it at a real Hugging Face directory for real text).
"""

import sys
import tempfile

from tokenloom import LLM, SamplingParams
from tokenloom.checkpoints.tiny_models import write_tiny_model


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else str(write_tiny_model(tempfile.mkdtemp(), "qwen3"))
    llm = LLM(model)

    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=42, max_tokens=16, n=2, logprobs=2)
    outs = llm.generate(["The capital of France is", [1, 2, 3, 4]], [greedy, sampled])
    for out in outs:
        for completion in out.outputs:
            print(f"{out.request_id}.{completion.index}: {completion.text!r}")
            print(f"   tokens={completion.token_ids} finish={completion.finish_reason}")
    print("first token's top logprobs:", outs[1].outputs[0].logprobs[0])

    chat = llm.chat([{"role": "user", "content": "Say hello in French."}], greedy)
    print("chat:", repr(chat[0].outputs[0].text))


if __name__ == "__main__":
    main()
