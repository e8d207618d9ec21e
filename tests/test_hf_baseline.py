"""tools/hf_baseline.py --tiny: the transformers + accelerate offload baseline runs end to end on a
CPU (disk offload included), so the GPU run does not fail for a silly reason."""
from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "hf_baseline.py"


def test_tiny_smoke(tmp_path, monkeypatch):
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    out = tmp_path / "hf.json"
    monkeypatch.setattr(sys, "argv", [str(TOOL), "--tiny", "--dir", str(tmp_path / "m"), "--out",
                                      str(out), "--rows", "reference,ram", "--new-tokens", "3"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(TOOL), run_name="__main__")
    assert e.value.code == 0
    res = json.loads(out.read_text())
    ref, ram = res["rows"]
    assert ref["placement"]["disk"]["layers"] > 0 and ref["decode_tok_s"] > 0
    assert ram["placement"]["cpu"]["layers"] == res["layers"] == 2
    assert res["greedy_ids_agree"] and len(ref["greedy_ids"]) == 3
    assert sum(ref["real_model_placement"]["layers"].values()) == 48 and ref["decode_tok_s_48"] > 0
