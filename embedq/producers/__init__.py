"""Producers: the Python client, the CLI and the bulk indexer. Never imports torch."""
