"""The package's version, a leaf module: the API reports it without importing the package's facade."""

__version__ = "0.1.0"
