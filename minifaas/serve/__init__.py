"""Serving: the gateway program, its worker processes, and the OpenAI-compatible HTTP API."""
