"""Version of the laminar-examples package (read by hatchling at build time)."""

__version__ = "0.1.0"
