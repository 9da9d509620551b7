"""The distribution version, kept in one place (read by setuptools and `vigil version`)."""

__version__ = "0.1.0"
