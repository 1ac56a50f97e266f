"""Step-time profiles shipped with sloserve (JSON, loaded by name)."""
