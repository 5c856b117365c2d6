"""`python -m client.cli`: the same as the `llmq` command."""

import sys

from client.cli.app import main

sys.exit(main())
