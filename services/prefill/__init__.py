"""Prefill service: computes prompt KV and ships it to decode workers."""
