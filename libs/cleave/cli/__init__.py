"""The `cleave` command.

Each subcommand is one module in this package exposing `register(subparsers)`, which adds its
parser and sets `handler` (argparse.Namespace -> exit code) as a default; `cleave.cli.main`
finds the modules itself. Every module is imported on every invocation (health checks run
`cleave health` every few seconds), so import heavy libraries such as torch inside handlers.
"""
