"""mnb's version, in a module of its own so that any part of mnb can name it
without importing the package's public face (``mnb/__init__.py`` stands above
everything; an import of it from below is an arrow back up)."""

__version__ = "0.1.0"
