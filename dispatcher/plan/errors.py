"""The one error the planning modules raise for a configuration they refuse (a leaf: every module of
``dispatcher.plan`` may import it, it imports none of them)."""


class ConfigError(ValueError):
    """A configuration the engine refuses; the message names the field, the value and the limit."""
