"""The policies app: batching policy records and the bridge that hands them to the engine."""
