"""The model layer's error (a leaf module: the loader and the FP8 reader both raise it)."""
from ..errors import ConfigError


class WeightsError(ConfigError):
    """Weights of a model directory that do not match its config: the message names the tensor."""
