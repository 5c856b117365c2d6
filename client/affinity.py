"""Cache affinity: the key by which workers send requests that start alike to the same worker.

Every caller computes it the same way from what it submits (the client, the gateway and `llmq batch` all submit
through `client.sync` or `client.aio`), so requests behind one system prompt or one document agree on it
without a tokenizer: a hash of the first `WINDOW_CHARS` characters of the prompt (chat messages as role, then
content, in order) or of the first `WINDOW_IDS` token ids. That is about two of the engine's 32-token cache pages:
prompts that agree this far usually share a longer prefix, and prompts that share less gain little from a cache.
The worker that reads an entry routes it by this key (`worker.affinity`, `read.lua`); it is only a hint.
"""

from __future__ import annotations

import hashlib

from client.protocol import GenerateRequest

WINDOW_CHARS = 256
WINDOW_IDS = 64


def affinity_key(request: GenerateRequest) -> bytes:
    """16 hex digits naming the start of the request's prompt."""
    if request.input_ids is not None:
        start = "ids:" + ",".join(str(token) for token in request.input_ids[:WINDOW_IDS])
    elif request.messages is not None:
        parts, length = [], 0
        for message in request.messages:  # no longer than the window, however long the conversation
            if length >= WINDOW_CHARS:
                break
            part = f"{message.role}\n{message.content or ''}\n"[: WINDOW_CHARS - length]
            parts.append(part)
            length += len(part)
        start = "chat:" + "".join(parts)
    else:
        start = "text:" + (request.prompt or "")[:WINDOW_CHARS]
    return hashlib.blake2b(start.encode(errors="surrogatepass"), digest_size=8).hexdigest().encode()
