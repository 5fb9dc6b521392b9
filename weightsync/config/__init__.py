"""The Hydra layer: structured configs, ConfigStore groups, receiver configs.

Importing this module registers every config in Hydra's ConfigStore (see
:mod:`weightsync.config.store` for the group names).
"""

from . import configs
from .configs import *  # noqa: F403 - every config class is public
from .receiver import (  # noqa: F401 - public: listed in __all__
    allow_targets,
    allowed_targets,
    check_receiver_config,
    from_config,
    make_receiver,
)
from .store import SCHEMES, STRATEGIES, TRANSPORTS, register_configs  # noqa: F401 - public: listed in __all__

register_configs()

__all__ = sorted(
    [
        *configs.__all__,
        "STRATEGIES",
        "allow_targets",
        "allowed_targets",
        "check_receiver_config",
        "from_config",
        "make_receiver",
        "register_configs",
    ]
)
