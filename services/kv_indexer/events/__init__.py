"""Event ingestion: the ZMQ subscriber (:mod:`.subscriber`) and the per-endpoint ordered pool (:mod:`.pool`)."""
