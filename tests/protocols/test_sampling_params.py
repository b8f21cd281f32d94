"""SamplingParams validation at the edges."""

import pytest

from tokenloom.protocols.sampling import MAX_SEED, InvalidParameter, SamplingParams


@pytest.mark.parametrize("seed", [-1, MAX_SEED, 2**64 - 1])
def test_seed_outside_a_signed_64_bit_range_is_refused(seed):
    with pytest.raises(InvalidParameter, match="seed"):
        SamplingParams(seed=seed)


def test_largest_seed_is_accepted_and_children_wrap(tiny_model_factory):
    from tokenloom.text.output_processor import OutputProcessor
    from tokenloom.text.tokenizer import Tokenizer

    proc = OutputProcessor(Tokenizer.from_dir(tiny_model_factory("llama")))
    children = proc.add_request("r", None, [1, 2], SamplingParams(seed=MAX_SEED - 1, n=2), [2])
    assert [c.params.seed for c in children] == [MAX_SEED - 1, 0]
