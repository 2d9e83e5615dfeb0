"""Fixtures of the LLM path: the example's small model (built once per session, no download),
a gateway serving it over real HTTP (uvicorn in a thread), a project with a key."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from store import services
from trainer.llm.server import ServerThread, build_gateway, quiet_transformers


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """Built under MODELS_DIR on first use and reused (the recipe names the directory)."""
    from django.conf import settings

    from examples.llm_cipher.model import base_checkpoint

    quiet_transformers()
    return base_checkpoint(settings.MODELS_DIR)


@pytest.fixture
def keyed(transactional_db: None):
    project = services.project_create(name="llm")
    _, raw = services.api_key_create(project=project, role="runner")
    other = services.project_create(name="llm-other")
    _, other_raw = services.api_key_create(project=other, role="runner")
    return project, raw, other, other_raw


@pytest.fixture
def gateway_server(model_dir: Path, transactional_db: None) -> Iterator[tuple]:
    # LLM_TEST_ENGINE_PROCESS=1: the same tests with the engine in its own process
    gateway = build_gateway(models=[f"tiny={model_dir}"],
                            engine_process=os.environ.get("LLM_TEST_ENGINE_PROCESS") == "1")
    server = ServerThread(gateway.app()).start()
    try:
        yield gateway, f"http://127.0.0.1:{server.port}"
    finally:
        server.stop()
