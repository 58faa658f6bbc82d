"""The Django side of the engine server: `manage.py serve_engine` and its control operations."""
