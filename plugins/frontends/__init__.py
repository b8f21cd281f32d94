"""Default frontends components."""
