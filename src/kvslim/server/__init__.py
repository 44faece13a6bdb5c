"""OpenAI-compatible HTTP server: FastAPI routes over an `AsyncEngine`; no model logic here."""
