"""The error every layer raises for a configuration that cannot be served (a leaf module: no imports)."""


class ConfigError(ValueError):
    """A configuration that cannot be served; the message says what to change."""
