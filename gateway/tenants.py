"""The gateway's tenants (`LLMQ_GATEWAY_TENANTS_FILE`): which API key acts for which tenant, and each tenant's
weight in fair share (`docs/tenants.md`). A JSON object, tenant name -> `{"keys": [...], "weight": 3}` (weight
optional, 1 by default). A key names one tenant: a request with it is submitted as that tenant, whatever its body
or headers say. Keys of `LLMQ_GATEWAY_API_KEYS` act for the default tenant."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from client.protocol import is_valid_name
from client.tenants import check_weight


@dataclass(frozen=True)
class TenantKeys:
    """Each key (bytes, for `hmac.compare_digest`) with the tenant it acts for, and the weights set."""

    keys: list[tuple[bytes, str]]
    weights: dict[str, float]


def load_tenants(path: Path) -> TenantKeys:
    """The tenants file, checked whole: a `ValueError` names what is wrong (never a key)."""
    try:
        data: Any = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable JSON file ({type(error).__name__})") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{path}: must be a JSON object of tenant -> {{'keys': [...], 'weight': ...}}")
    keys: list[tuple[bytes, str]] = []
    weights: dict[str, float] = {}
    seen: set[bytes] = set()
    for tenant, entry in data.items():
        if not is_valid_name(tenant):
            raise ValueError(f"{path}: tenant {tenant!r} must be 1-128 characters of [A-Za-z0-9._:-]")
        if not isinstance(entry, dict) or set(entry) - {"keys", "weight"}:
            raise ValueError(f"{path}: tenant {tenant!r} must be an object with 'keys' and an optional 'weight'")
        given = entry.get("keys")
        if not isinstance(given, list) or not given or not all(isinstance(k, str) and k.strip() for k in given):
            raise ValueError(f"{path}: tenant {tenant!r} needs 'keys', a list of non-empty strings")
        for key in given:
            token = key.strip().encode()
            if token in seen:
                raise ValueError(f"{path}: a key of tenant {tenant!r} is listed twice: each key names one tenant")
            seen.add(token)
            keys.append((token, tenant))
        if "weight" in entry:
            try:
                weights[tenant] = check_weight(entry["weight"])
            except ValueError as error:
                raise ValueError(f"{path}: tenant {tenant!r}: {error}") from None
    return TenantKeys(keys, weights)
