"""Wire schemas: the ingest payload (``ingest``) and the API responses (``responses``)."""
