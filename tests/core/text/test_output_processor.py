"""Output processing: n > 1 expansion, streaming deltas, stop strings, logprobs."""

from __future__ import annotations

import pytest

from tokenloom.protocols.outputs import TokenDelta, TopLogprobs
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.text.output_processor import OutputProcessor, find_first_stop
from tokenloom.text.request_output import RequestOutput
from tokenloom.text.tokenizer import Tokenizer

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(tiny_model_factory) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_factory("llama"))


@pytest.fixture
def processor(tokenizer: Tokenizer) -> OutputProcessor:
    return OutputProcessor(tokenizer)


def add(processor: OutputProcessor, request_id: str, params: SamplingParams) -> list[str]:
    requests = processor.add_request(request_id, "prompt", [5, 6, 7], params, [EOS])
    return [r.request_id for r in requests]


def feed_one_by_one(
    processor: OutputProcessor, engine_id: str, ids: list[int], finish: str | None = "length"
) -> tuple[list[RequestOutput], list[str]]:
    """Send ``ids`` one token per step; returns every output and every abort id."""
    outputs, aborts = [], []
    for i, token_id in enumerate(ids):
        last = i == len(ids) - 1
        result = processor.process([TokenDelta(engine_id, [token_id], finish if last else None)])
        outputs += result.outputs
        aborts += result.abort_ids
    return outputs, aborts


def test_a_single_request_keeps_its_id_and_streams_to_the_full_text(
    processor: OutputProcessor, tokenizer: Tokenizer
) -> None:
    params = SamplingParams(max_tokens=50)
    assert add(processor, "r1", params) == ["r1"]
    ids = tokenizer.encode("naïve 日本 🎉 text", add_special_tokens=False)
    outputs, aborts = feed_one_by_one(processor, "r1", ids)
    final = outputs[-1].outputs[0]
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert final.text == "naïve 日本 🎉 text" and final.token_ids == ids
    assert final.finish_reason == "length" and aborts == []
    assert "".join(o.outputs[0].text_delta for o in outputs) == final.text
    assert sum((o.outputs[0].token_ids_delta for o in outputs), []) == ids
    assert not processor.has_unfinished_requests()


def test_n_expands_into_seeded_children_that_share_the_prompt(
    processor: OutputProcessor,
) -> None:
    requests = processor.add_request("r", None, [9, 8, 7], SamplingParams(n=3, seed=5), [EOS])
    assert [r.request_id for r in requests] == ["r/0", "r/1", "r/2"]
    assert [r.params.seed for r in requests] == [5, 6, 7]
    assert all(r.params.n == 1 and r.prompt_token_ids == [9, 8, 7] for r in requests)
    unseeded = processor.add_request("u", None, [1], SamplingParams(n=2), [EOS])
    assert [r.params.seed for r in unseeded] == [None, None]


def test_children_are_gathered_into_one_output_finished_when_all_finish(
    processor: OutputProcessor, tokenizer: Tokenizer
) -> None:
    add(processor, "r", SamplingParams(n=2))
    a, b = (tokenizer.encode(t, add_special_tokens=False) for t in ("first", "second"))
    step1 = processor.process([TokenDelta("r/1", b, "length"), TokenDelta("r/0", a[:1])])
    assert len(step1.outputs) == 1 and not step1.outputs[0].finished
    assert [c.index for c in step1.outputs[0].outputs] == [0, 1]
    assert step1.outputs[0].outputs[1].finish_reason == "length"
    step2 = processor.process([TokenDelta("r/0", a[1:], "stop")])
    done = step2.outputs[0]
    assert done.finished and [c.text for c in done.outputs] == ["first", "second"]
    assert done.outputs[1].text_delta == "" and done.outputs[0].finish_reason == "stop"


def test_a_stop_string_truncates_finishes_and_asks_for_an_abort(
    processor: OutputProcessor, tokenizer: Tokenizer
) -> None:
    add(processor, "r", SamplingParams(stop=["world"]))
    ids = tokenizer.encode("Hello world, and more", add_special_tokens=False)
    outputs, aborts = feed_one_by_one(processor, "r", ids, finish=None)
    final = outputs[-1]
    assert final.finished and aborts == ["r"]
    assert final.outputs[0].text == "Hello "
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == "world"
    streamed = "".join(o.outputs[0].text_delta for o in outputs)
    assert streamed == "Hello " and "w" not in streamed
    # The engine's reply to the abort comes later and changes nothing.
    assert processor.process([TokenDelta("r", [], "abort")]).outputs == []


def test_streaming_holds_back_what_could_start_a_stop_string(
    processor: OutputProcessor, tokenizer: Tokenizer
) -> None:
    add(processor, "r", SamplingParams(stop=["XYZW"]))
    ids = tokenizer.encode("abcdefgh", add_special_tokens=False)
    outputs, aborts = feed_one_by_one(processor, "r", ids)
    for out in outputs[:-1]:
        assert len(out.outputs[0].text) <= len(tokenizer.decode(out.outputs[0].token_ids)) - 3
    assert outputs[-1].outputs[0].text == "abcdefgh" and aborts == []
    assert "".join(o.outputs[0].text_delta for o in outputs) == "abcdefgh"


def test_the_earliest_stop_string_wins_even_within_one_delta(
    processor: OutputProcessor, tokenizer: Tokenizer
) -> None:
    add(processor, "r", SamplingParams(stop=["lazy", "quick"]))
    ids = tokenizer.encode("the quick brown fox is lazy", add_special_tokens=False)
    result = processor.process([TokenDelta("r", ids)])
    out = result.outputs[0].outputs[0]
    assert out.text == "the " and out.stop_reason == "quick" and result.abort_ids == ["r"]
    assert tokenizer.decode(out.token_ids).startswith("the quick")
    assert not tokenizer.decode(out.token_ids).startswith("the quick brown")
    assert find_first_stop("a b c", ["c", "b"], 0) == (2, "b")


def test_a_stop_token_id_is_kept_in_ids_and_out_of_the_text(
    processor: OutputProcessor, tokenizer: Tokenizer
) -> None:
    stop_id = tokenizer.encode("!", add_special_tokens=False)[0]
    add(processor, "s", SamplingParams(stop_token_ids=[stop_id]))
    add(processor, "e", SamplingParams())
    hi = tokenizer.encode("hi", add_special_tokens=False)
    result = processor.process(
        [TokenDelta("s", hi + [stop_id], "stop"), TokenDelta("e", hi + [EOS], "stop")]
    )
    by_id = {o.request_id: o.outputs[0] for o in result.outputs}
    assert by_id["s"].text == "hi" and by_id["s"].token_ids == hi + [stop_id]
    assert by_id["s"].stop_reason == stop_id
    assert by_id["e"].text == "hi" and by_id["e"].stop_reason is None


def test_logprobs_are_collected_per_token_with_their_alternatives(
    processor: OutputProcessor,
) -> None:
    add(processor, "r", SamplingParams(logprobs=1))
    tops = [TopLogprobs([40], [-0.1]), TopLogprobs([41], [-0.2])]
    processor.process([TokenDelta("r", [40], logprobs=[-0.1], top_logprobs=tops[:1])])
    result = processor.process(
        [TokenDelta("r", [50], "length", logprobs=[-2.5], top_logprobs=tops[1:])]
    )
    out = result.outputs[0].outputs[0]
    assert out.logprobs == [{40: -0.1}, {41: -0.2, 50: -2.5}]
    assert out.logprobs_delta == [{41: -0.2, 50: -2.5}]
    assert out.cumulative_logprob == pytest.approx(-2.6)


def test_without_logprobs_requested_none_are_reported(processor: OutputProcessor) -> None:
    add(processor, "r", SamplingParams())
    result = processor.process([TokenDelta("r", [40], "length", logprobs=[-0.1])])
    assert result.outputs[0].outputs[0].logprobs is None
    assert result.outputs[0].outputs[0].cumulative_logprob is None


def test_abort_request_returns_the_unfinished_engine_ids_and_forgets(
    processor: OutputProcessor,
) -> None:
    add(processor, "r", SamplingParams(n=3))
    processor.process([TokenDelta("r/1", [40], "length")])
    assert processor.abort_request("r") == ["r/0", "r/2"]
    assert processor.process([TokenDelta("r/0", [41])]).outputs == []
    assert processor.abort_request("r") == [] and not processor.has_unfinished_requests()


def test_a_request_id_in_flight_cannot_be_reused(processor: OutputProcessor) -> None:
    add(processor, "r", SamplingParams())
    with pytest.raises(ValueError, match="already in flight"):
        add(processor, "r", SamplingParams())


def test_non_streaming_mode_gives_the_same_final_outputs_and_reports_only_finished(
    tiny_model_factory,
):
    from tokenloom.protocols.outputs import TokenDelta
    from tokenloom.protocols.sampling import SamplingParams
    from tokenloom.text.output_processor import OutputProcessor
    from tokenloom.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_model_factory("llama"))
    ids = tokenizer.encode("Café 日本語 and emoji 🎉 end", add_special_tokens=False)
    eos = tokenizer.eos_token_ids[0]
    finals = {}
    for stream in (True, False):
        proc = OutputProcessor(tokenizer, stream=stream)
        params = SamplingParams(max_tokens=100)
        proc.add_request("r", None, [1, 2, 3], params, [eos])
        reported = []
        for token in ids:
            reported += proc.process([TokenDelta("r", [token])]).outputs
            if not stream:
                assert not reported, "unfinished requests are not reported without streaming"
        last = proc.process([TokenDelta("r", [eos], finish_reason="stop")]).outputs
        assert last and last[-1].finished
        finals[stream] = last[-1].outputs[0]
    assert finals[True].text == finals[False].text == tokenizer.decode(ids)
    assert finals[True].token_ids == finals[False].token_ids == [*ids, eos]
