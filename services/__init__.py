"""The cleave services; each runs as `python -m services.<name>`."""
