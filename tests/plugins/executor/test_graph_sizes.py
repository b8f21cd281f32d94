"""Decode CUDA-graph buckets: sizes up to the cap the config sets (``max_graph_batch``,
default 512, as before), so a ``max_num_seqs`` above 512 can replay graphs too."""

from __future__ import annotations

import pytest

from tokenloom.config import ConfigError, EngineConfig, load_config
from tokenloom.plugins.executor.cuda_graphs import graph_batch_sizes


def test_buckets_are_powers_of_two_then_every_16_up_to_the_top():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = graph_batch_sizes(640)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-3:] == [608, 624, 640]
    assert sizes == sorted(set(sizes)) and 512 in sizes


def test_the_graph_cap_defaults_to_512_and_is_a_config_field():
    assert EngineConfig().max_graph_batch == 512
    assert load_config(max_graph_batch=640).max_graph_batch == 640
    with pytest.raises(ConfigError, match="max_graph_batch"):
        load_config(max_graph_batch=0)
