"""Colab ships ipywidgets 7.7.1 and the setup cell leaves it alone, so the widgets must work with it too."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COLAB_IPYWIDGETS = ("ipywidgets==7.7.1", "ipython_genutils==0.2.0")  # 7.x imports ipython_genutils


def test_widget_tests_pass_with_colabs_ipywidgets_7(tmp_path):
    target = tmp_path / "ipywidgets7"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                              *COLAB_IPYWIDGETS], capture_output=True, text=True)
    if install.returncode:
        pytest.skip(f"could not install {COLAB_IPYWIDGETS} here (no package registry?): {install.stderr[-300:]}")
    env = {**os.environ, "PYTHONPATH": str(target)}
    version = subprocess.run([sys.executable, "-c", "import ipywidgets; print(ipywidgets.__version__)"],
                             env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert version == "7.7.1"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_widgets.py",
                          "-W", "ignore::DeprecationWarning"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:]
