"""Gateway service: the public gRPC (and OpenAI-compatible HTTP) API of cleave."""
