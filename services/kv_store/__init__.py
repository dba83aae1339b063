"""kv_store: a tiered store of KV-cache blocks (values) addressed by string keys."""
