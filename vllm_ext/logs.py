"""Where delta-sync's log records go inside a vLLM process."""

from __future__ import annotations

import logging

__all__ = ["route_delta_sync_logs"]


def route_delta_sync_logs() -> None:
    """Send the `delta_sync` logger's records through vLLM's log handlers.

    delta-sync logs through the standard `logging` module; inside a vLLM process only
    vLLM's own logger tree has handlers, so the receiver's messages would otherwise be
    lost (or printed unformatted). Does nothing when the `delta_sync` logger already has
    handlers (the user configured it, or this ran before) or when vLLM's logger has none
    (vLLM's logging configuration is turned off), so it is safe to call more than once.

    Example:
        ```python
        >>> route_delta_sync_logs()  # in DeltaWeightTransferEngine.__init__
        ```
    """
    library_logger = logging.getLogger("delta_sync")
    vllm_handlers = logging.getLogger("vllm").handlers
    if library_logger.handlers or not vllm_handlers:
        return
    library_logger.handlers = list(vllm_handlers)
    library_logger.setLevel(logging.INFO)
    library_logger.propagate = False
