"""Token pipelines: stages, microbatches, swapping, and their liveness defaults."""

from enum import StrEnum


class SwapMode(StrEnum):
    """Microbatch KV swapping on a token stage (DejaVu §4.3)."""

    ON = "on"
    OFF = "off"
    AUTO = "auto"  # each stage decides on its own measurements (Appendix E)


# One liveness setting for every beat in the system: a stage to its head, a node to the
# controller; anything silent for DEAD_AFTER_S is lost (the head's view and the controller's).
HEARTBEAT_S = 0.25
DEAD_AFTER_S = 5.0
PROMPT_SLOTS = 16  # prompt KVs a stage holds before their requests are admitted
