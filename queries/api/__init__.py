"""The PIR REST API (PROTOCOL.md section 5)."""
