"""The queries app: the PIR REST API, its client, and (later) bulk query jobs."""
