"""The distributed tests."""
