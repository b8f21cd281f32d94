"""Default proposer components."""
