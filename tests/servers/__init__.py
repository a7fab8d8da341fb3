"""Pytest plugins that start real servers for the tests (registered in tests/conftest.py)."""
