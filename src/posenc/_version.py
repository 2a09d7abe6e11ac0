"""The version of posenc, in a module of its own so that the lowest layers can read it without importing the package's
public face (posenc/__init__.py imports the models)."""

__version__ = "0.1.0"
