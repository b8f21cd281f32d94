"""Default kv_cache components."""
