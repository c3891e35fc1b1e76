import sys

import pytest

from orchestrator.engine import trtllm_engine


def test_missing_tensorrt_llm_explains_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # import now raises ImportError
    with pytest.raises(RuntimeError, match="pip install tensorrt-llm"):
        trtllm_engine.load_trtllm_engine(tmp_path)
