from __future__ import annotations

# Test servers, each a module of session-scoped fixtures.
pytest_plugins = [
    "tests.servers.moto",
    "tests.servers.seaweed",
    "tests.servers.fakegcs",
    # where the multi-process (gloo) tests save: the `target` fixture
    "tests.multirank",
]
