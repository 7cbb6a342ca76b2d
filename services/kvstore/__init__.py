"""KV store service: content-addressed KV blocks in RAM and disk tiers."""
