"""flowrl's logs carry its own lines: the models it loads show no library loading bar (the caller's own loads keep
theirs), and DeepSpeed's warning on import without a GPU is filtered out of a ZeRO launch's logs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_flowrl_loads_a_model_without_the_librarys_loading_bar_and_leaves_the_callers_on(capfd):
    from transformers import CLIPModel
    from transformers.utils import logging as transformers_logging

    from flowrl.rewards.base import load_pretrained, quiet_loading

    clip = REPO / "assets" / "tiny-clip"
    was = transformers_logging.is_progress_bar_enabled()
    transformers_logging.enable_progress_bar()
    try:
        with quiet_loading():
            assert not transformers_logging.is_progress_bar_enabled()
        assert transformers_logging.is_progress_bar_enabled()
        capfd.readouterr()
        load_pretrained(CLIPModel, clip, "clipscore")
        assert "Loading weights" not in capfd.readouterr().err and transformers_logging.is_progress_bar_enabled()
        CLIPModel.from_pretrained(clip)  # the caller's own load keeps its bar: the check above can fail
        assert "Loading weights" in capfd.readouterr().err
    finally:
        (transformers_logging.enable_progress_bar if was else transformers_logging.disable_progress_bar)()


@pytest.mark.parametrize("quiet", [True, False])
def test_deepspeeds_cpu_notice_is_filtered_and_its_other_warnings_kept(quiet):
    """DeepSpeed logs the notice when it is imported (as accelerate imports it on a ZeRO launch); a fresh interpreter
    imports it with and without :func:`flowrl.zero.quiet_cpu_notice`."""
    pytest.importorskip("deepspeed")
    code = (
        "import torch\n"
        "if torch.cuda.is_available():\n    print('GPU')\n    raise SystemExit\n"
        + ("from flowrl.zero import quiet_cpu_notice\nquiet_cpu_notice()\nquiet_cpu_notice()\n" if quiet else "")
        + "import deepspeed\nfrom deepspeed.utils import logger\nlogger.warning('another warning')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    if out.stdout.strip() == "GPU":
        pytest.skip("DeepSpeed finds the GPU: no CPU notice to filter")
    logs = out.stdout + out.stderr
    assert ("Setting accelerator to CPU" in logs) is not quiet and "another warning" in logs
