"""HTTP in front of engines: the engine server (SGLang ``/generate``, the OpenAI surface), its
request schemas, the raw-body router, and the session server (multi-turn, agents)."""

DEFAULT_ENGINE_PORT = 30000  # SGLang's default port
DEFAULT_ROUTER_PORT = 30010
DEFAULT_SESSIONS_PORT = 30020
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
# FastAPI's native OpenTelemetry looks its providers up in the environment on every request: off
NO_TELEMETRY = {"tracing": False, "metrics": False, "logs": False}
