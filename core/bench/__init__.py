"""Benchmarks: `tokenloom bench NAME`. Each prints a table and writes JSON."""
