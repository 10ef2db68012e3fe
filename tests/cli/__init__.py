"""The cli tests."""
