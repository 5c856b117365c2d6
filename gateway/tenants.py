"""The gateway's tenants (`LLMQ_GATEWAY_TENANTS_FILE`): which API key acts for which tenant, and each tenant's
weight in fair share and quotas (`docs/tenants.md`). A JSON object, tenant name -> `{"keys": [...], "weight": 3,
"limits": {"max_queued": 100, ...}, "retry_after_s": 5}` (all but keys optional: weight 1, no quotas, the gateway's
Retry-After). A key names one tenant: a request with it is submitted as that tenant, whatever its body or headers
say. Keys of `LLMQ_GATEWAY_API_KEYS` act for the default tenant."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from client.protocol import is_valid_name
from client.tenants import TenantLimits, check_weight

FIELDS = {"keys", "weight", "limits", "retry_after_s"}


@dataclass(frozen=True)
class TenantKeys:
    """Each key (bytes, for `hmac.compare_digest`) with the tenant it acts for, and the weights, quotas and
    Retry-After seconds (of a 429 for its quota) set."""

    keys: list[tuple[bytes, str]]
    weights: dict[str, float] = field(default_factory=dict)
    limits: dict[str, TenantLimits] = field(default_factory=dict)
    retry_after_s: dict[str, int] = field(default_factory=dict)


def load_tenants(path: Path) -> TenantKeys:
    """The tenants file, checked whole: a `ValueError` names what is wrong (never a key)."""
    try:
        data: Any = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable JSON file ({type(error).__name__})") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{path}: must be a JSON object of tenant -> {{'keys': [...], 'weight': ...}}")
    found = TenantKeys([])
    seen: set[bytes] = set()
    for tenant, entry in data.items():
        if not is_valid_name(tenant):
            raise ValueError(f"{path}: tenant {tenant!r} must be 1-128 characters of [A-Za-z0-9._:-]")
        if not isinstance(entry, dict) or set(entry) - FIELDS:
            raise ValueError(f"{path}: tenant {tenant!r} must be an object of {', '.join(sorted(FIELDS))}")
        given = entry.get("keys")
        if not isinstance(given, list) or not given or not all(isinstance(k, str) and k.strip() for k in given):
            raise ValueError(f"{path}: tenant {tenant!r} needs 'keys', a list of non-empty strings")
        for key in given:
            token = key.strip().encode()
            if token in seen:
                raise ValueError(f"{path}: a key of tenant {tenant!r} is listed twice: each key names one tenant")
            seen.add(token)
            found.keys.append((token, tenant))
        try:
            _settings(found, tenant, entry)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{path}: tenant {tenant!r}: {error}") from None
    return found


def _settings(found: TenantKeys, tenant: str, entry: dict[str, Any]) -> None:
    if "weight" in entry:
        found.weights[tenant] = check_weight(entry["weight"])
    if "limits" in entry:
        if not isinstance(entry["limits"], dict):
            raise ValueError(
                "'limits' must be an object of max_queued, max_queued_tokens, max_running, tokens_per_minute"
            )
        found.limits[tenant] = TenantLimits(**entry["limits"])  # an unknown name: TypeError
    if "retry_after_s" in entry:
        seconds = entry["retry_after_s"]
        if isinstance(seconds, bool) or not isinstance(seconds, int) or not 0 <= seconds <= 86400:
            raise ValueError(f"'retry_after_s' must be a whole number of seconds in [0, 86400], not {seconds!r}")
        found.retry_after_s[tenant] = seconds
