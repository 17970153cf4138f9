"""Data parallel: see the modules of this package."""
