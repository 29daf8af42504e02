"""The router's OpenAI-compatible HTTP front: /v1/completions, /v1/chat/completions, /v1/models.

It runs in the router's own process and event loop (`--http-port`) and calls the router core
through `services/router/generation.py`, the same path as the gRPC Generate: API keys, rate
limits, idempotency, deadlines and cancellation behave alike on both. `requests.py` maps and
validates bodies, `responses.py` builds the JSON, `errors.py` maps errors to OpenAI's shape and
HTTP statuses, `app.py` holds the routes and the server.
"""
