"""The package version (one place: the package, the plan store fingerprint and `cudnorm info` read it)."""

__version__ = "0.1.0"
