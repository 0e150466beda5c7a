"""laminar_trainer: see the package README for what this tier owns."""

from .version import __version__

__all__ = ["__version__"]
