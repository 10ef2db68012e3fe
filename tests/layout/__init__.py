"""The layout tests."""
