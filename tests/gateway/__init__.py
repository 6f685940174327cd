"""Gateway tests."""
