"""cleave: disaggregated prefill/decode LLM serving for reasoning models."""

__version__ = "0.1.0"
