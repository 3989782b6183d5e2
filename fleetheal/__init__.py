"""fleetheal: self-healing GPU training clusters."""

__version__ = "0.1.0"
