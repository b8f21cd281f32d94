"""The command line and the server process."""
