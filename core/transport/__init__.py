"""How messages cross processes: msgspec serialisation and the one socket factory."""
