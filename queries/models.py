"""Query records; none yet (bulk job records arrive with the Celery work)."""
