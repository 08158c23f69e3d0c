"""The adapter's logger, made through AReaL's ``getLogger`` (AReaL rebuilds the logging
tree whenever it creates a logger, which silences loggers made the standard way)."""
from areal.utils import logging as areal_logging

logger = areal_logging.getLogger("areal-tik")
