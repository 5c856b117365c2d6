"""Fixtures of other components that end-to-end tests start too."""

from tests.gateway.conftest import gateway  # noqa: F401 - gateways on free ports, here on a cluster URL
