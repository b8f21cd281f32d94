"""The engine-core: the loop, its process, its supervision, and the client that talks to it."""
