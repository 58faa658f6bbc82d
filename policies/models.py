"""Batching policy records; none yet (they arrive with the live-policy work)."""
