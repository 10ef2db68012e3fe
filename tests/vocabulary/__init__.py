"""The vocabulary tests."""
