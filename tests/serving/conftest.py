"""Servers the serving tests share: one deterministic engine behind ``serve``'s app and our router."""

import pytest

from support_replay.engine import Engine, EngineSettings
from support_replay.serving.router import Router, create_router_app
from support_replay.serving.server import create_app
from support_replay.serving.threaded import ThreadedServer


@pytest.fixture(scope="package")
def served_with_router(tiny_agent_checkpoint):
    """``(engine, serve's URL, the router's URL)``: a deterministic engine (answers do not depend on what
    else is in the batch), its app on loopback, our router in front."""
    engine = Engine.from_pretrained(tiny_agent_checkpoint, EngineSettings(deterministic=True)).start()
    server = ThreadedServer(create_app(engine, model_name="tiny")).start()
    router = ThreadedServer(create_router_app(Router([server.url], health_interval=0.5)), lifespan="on").start()
    yield engine, server.url, router.url
    router.stop()
    server.stop()
    engine.shutdown()
