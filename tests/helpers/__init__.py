"""Shared test helpers: real processes, bucket objects, fixtures, the storage contract."""
