"""Token pipelines: stages, microbatches, swapping, and their liveness defaults."""

import math
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


def prompt_slots(prefill_nodes: int, token_pipelines: int) -> int:
    """Prompt-KV slots of each token pipeline: PROMPT_SLOTS for every P-node that feeds it.
    A request reserves its slot before its prefill, so the slots are also the P-nodes'
    queues: 6 P-nodes on 2 T-nodes of 16 slots each served 12% below either pool's rate
    (simulated, Azure code trace; 3% with 48), the pools waiting on each other."""
    return PROMPT_SLOTS * max(1, math.ceil(prefill_nodes / token_pipelines))


def check_prefill_chunk(prefill_chunk: int, batch_size: int) -> None:
    """A budget below the batch size could leave a prompt no token in a full microbatch."""
    if prefill_chunk < 0 or 0 < prefill_chunk < batch_size:
        raise ValueError(f"prefill_chunk must be 0 (whole prompts) or at least the batch size "
                         f"{batch_size} (a step's token steps fit in it), got {prefill_chunk}")
