"""Which engine a node runs: the torch engine (default), or the emulated one on a profile."""

from __future__ import annotations

from pathlib import Path

from orchestrator.engine.base import Engine
from orchestrator.layout import StageSpec


def load_stage_engine(
    model_dir: str | Path,
    stage: StageSpec | None = None,
    device: str = "cpu",
    profile: str = "",
    max_seq_len: int | None = None,
    time_scale: float = 1.0,
) -> Engine:
    """``profile`` (a profile file or a shipped profile's name): the emulated engine timed
    by it (its times x ``time_scale``), shaped by ``model_dir``'s config; empty: the torch
    engine on ``model_dir``."""
    if not profile:
        from orchestrator.engine.torch_engine import load_engine

        kwargs = {} if max_seq_len is None else {"max_seq_len": max_seq_len}
        return load_engine(model_dir, stage, device, **kwargs)
    from orchestrator.engine.emulated import load_emulated_engine
    from orchestrator.profiles.profile import load_profile

    return load_emulated_engine(str(model_dir), load_profile(profile), stage, max_seq_len,
                                time_scale)


def load_stage_engines(
    model_dir: str | Path, depth: int, device: str = "cpu", profile: str = "",
    max_seq_len: int | None = None, time_scale: float = 1.0,
) -> list[Engine]:
    """The model split evenly into ``depth`` stages, each its own engine (a P-node's)."""
    from orchestrator.engine.config import ModelConfig

    num_layers = ModelConfig.from_dir(model_dir).num_layers
    return [load_stage_engine(model_dir, stage, device, profile, max_seq_len, time_scale)
            for stage in StageSpec.split(num_layers, depth)]
