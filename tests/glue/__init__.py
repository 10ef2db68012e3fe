"""The glue tests."""
