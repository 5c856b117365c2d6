"""`llmq`: submit a prompt, follow or cancel a request, chat, look at queues, handle dead letters, run batch files.

One module per job: `parser` (the command line), `context` (what a command gets), `exits` (exit codes and error
lines), `output` (stdout and stderr), `generate`, `chat`, `status` and `dead` (the commands), `app` (`main`).
Operator reads and writes of Redis are in `client.admin` and `client.dead_letters`.
"""

from client.cli.app import main

__all__ = ["main"]
