"""HTTP in front of engines: the engine server (SGLang ``/generate``, OpenAI chat completions),
its request schemas, and the raw-body router."""

DEFAULT_ENGINE_PORT = 30000  # SGLang's default port
DEFAULT_ROUTER_PORT = 30010
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
