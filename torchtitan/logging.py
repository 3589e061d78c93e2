"""The trainer's logger: rank 0 logs at INFO, the other ranks only warnings and errors."""

import logging
import sys

logger = logging.getLogger("torchtitan")


def init_logger(rank: int = 0) -> None:
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[titan] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
