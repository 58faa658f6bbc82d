"""REST API of epoch records and row updates (operators only)."""
