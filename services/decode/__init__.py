"""Decode service: admits prompt KV, runs continuous batching, streams tokens per step."""
