from __future__ import annotations

# Server fixtures (moto, SeaweedFS, ...) live in tests/servers/, one plugin module each.
pytest_plugins = ["tests.servers.moto", "tests.servers.seaweed"]
