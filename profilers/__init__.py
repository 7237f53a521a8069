"""profilers package."""
