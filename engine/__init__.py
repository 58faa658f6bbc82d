"""The engine app: the Django side of the engine (holder, settings, health, metrics, dashboard, server)."""
