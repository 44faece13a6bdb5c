"""OpenAI-compatible HTTP server: FastAPI routes over an `AsyncEngine`; no model logic here.

    app.py           routes, API key, lifespan        protocol.py   OpenAI request/response models
    async_engine.py  the engine thread and its queues completions.py / chat.py  the two APIs
    errors.py        OpenAI error bodies for all      metrics.py    Prometheus, own registry
    streaming.py     SSE framing, disconnects         logprobs.py   the two logprobs shapes

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /tokenize,
POST /detokenize (these need the key when --api-key is set), GET /health, GET /metrics."""
