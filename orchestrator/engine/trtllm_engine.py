"""TensorRT-LLM engine adapter: the GPU production runtime, behind an import guard.

TensorRT-LLM needs Linux, CUDA 12 and an NVIDIA GPU, so it cannot be installed
here. This module only fails clearly; the torch engine (``device="cuda"``) is
the runtime that works on GPUs today.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

INSTALL_HINT = (
    "TensorRT-LLM is not installed. It needs Linux x86_64/aarch64, CUDA 12 and an NVIDIA GPU: "
    "`pip install tensorrt-llm --extra-index-url https://pypi.nvidia.com`, or run inside the "
    "NGC image nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3. "
    "Without it, use the torch engine: load_engine(model_dir, device='cuda')."
)


def require_tensorrt_llm() -> ModuleType:
    try:
        import tensorrt_llm
    except ImportError as e:
        raise RuntimeError(INSTALL_HINT) from e
    return tensorrt_llm


def load_trtllm_engine(engine_dir: str | Path, **kwargs) -> None:
    """Not implemented yet: exporting TensorRT-LLM's paged KV into our per-sequence
    slots is the missing piece. Fails with the install hint when the package is absent."""
    require_tensorrt_llm()
    raise NotImplementedError(
        "the TensorRT-LLM adapter is not implemented; "
        "use orchestrator.engine.torch_engine.load_engine"
    )
