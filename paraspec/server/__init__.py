"""`paraspec serve`: the OpenAI-compatible HTTP API over one Engine (app.py), its request queue (queue.py), request
schemas (schemas.py) and Prometheus metrics (metrics.py)."""

from paraspec.server.app import create_app, serve

__all__ = ["create_app", "serve"]
