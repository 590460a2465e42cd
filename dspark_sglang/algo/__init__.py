"""algo package."""
