"""The embedded default's gateway (trainer/llm/embedded.py): in `train`'s process, with its
engine in a process of its own and a shorter switch interval when settings say so, both
undone when the block ends."""

from __future__ import annotations

import multiprocessing
import sys

import pytest

from trainer.llm.embedded import embedded_gateway

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def free_port(settings) -> None:
    settings.LLM_GATEWAY_PORT = 0  # any free port: other runs may hold the default


@pytest.fixture(autouse=True)
def python_switch_interval():
    """Python's default interval to start from, whatever a test before in this process set
    (an in-process `llm_serve` sets its own); given back after."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(interval)


def test_by_default_everything_runs_in_this_process(transactional_db, settings) -> None:
    settings.LLM_EMBEDDED_ENGINE_PROCESS = False
    settings.LLM_EMBEDDED_SWITCH_INTERVAL_MS = 0.0
    before, interval = set(multiprocessing.active_children()), sys.getswitchinterval()
    with embedded_gateway() as url:
        assert url.startswith("http://") and url.endswith("/v1")
        assert set(multiprocessing.active_children()) == before
        assert sys.getswitchinterval() == interval


def test_engine_process_and_switch_interval_while_the_block_runs(transactional_db,
                                                                  settings) -> None:
    settings.LLM_EMBEDDED_ENGINE_PROCESS = True
    settings.LLM_EMBEDDED_SWITCH_INTERVAL_MS = 0.5
    before, interval = set(multiprocessing.active_children()), sys.getswitchinterval()
    assert interval != 0.0005
    with embedded_gateway():
        engines = set(multiprocessing.active_children()) - before
        assert len(engines) == 1 and all(p.is_alive() for p in engines)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    assert not any(p.is_alive() for p in engines)  # stopped with the gateway
    assert sys.getswitchinterval() == interval
