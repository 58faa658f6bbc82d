"""The PIR REST API (docs/PROTOCOL.md section 5)."""
