"""The project tests."""
