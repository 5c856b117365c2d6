"""An OpenAI-compatible HTTP gateway over the queue: stateless, so run as many replicas as you like."""
