"""deepnvme version, kept in one place for setup.py and the report."""

__version__ = "0.1.0"
