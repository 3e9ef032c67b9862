"""End-to-end tests on a real container engine (pytest -m e2e)."""
