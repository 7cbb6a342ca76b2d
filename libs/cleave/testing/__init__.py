"""Test helpers shared across cleave's test suites (tiny checkpoints, ...)."""
