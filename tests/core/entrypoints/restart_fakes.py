"""An engine factory for restart tests: the serving fake engine, which refuses to
start a second time once ``$TOKENLOOM_TEST_START_MARKER`` (a file) exists.
Module-level so that a spawned engine-core imports it by reference."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from serving_fakes import make_fake_engine


def make_engine_once(config: Any, plugin_manager: Any) -> Any:
    marker = Path(os.environ["TOKENLOOM_TEST_START_MARKER"])
    if marker.exists():
        raise RuntimeError("fake engine refuses to start again")
    marker.write_text("started")
    return make_fake_engine(config, plugin_manager)
