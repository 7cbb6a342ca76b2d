"""Synthetic, verifiable tasks used to train and benchmark the built-in reasoning model."""
