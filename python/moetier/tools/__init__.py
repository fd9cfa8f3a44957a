"""Tooling apart from the runtime: models (PyPI fetcher), moefy (dense -> MoE), tiny (fixture writer)."""
