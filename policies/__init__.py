"""The policies app: batching policy records and the policy source that hands them to the engine."""
