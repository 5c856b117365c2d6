"""What every handler shares: settings, the one queue client, the model directory, the metrics and the Batch API's
store."""

from __future__ import annotations

from dataclasses import dataclass

from structlog.typing import FilteringBoundLogger

from client import AsyncClient
from gateway.batch_store import BatchStore
from gateway.metrics import GatewayMetrics
from gateway.models import ModelDirectory
from gateway.settings import GatewaySettings


@dataclass(frozen=True)
class Gateway:
    settings: GatewaySettings
    client: AsyncClient
    models: ModelDirectory
    metrics: GatewayMetrics
    log: FilteringBoundLogger
    batches: BatchStore
