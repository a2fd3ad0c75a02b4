"""The public API: exactly the core names in gradspec, the training recipes in gradspec.training, the
names that moved still resolving for one release with a warning, and each documented where it lives."""

import importlib
import inspect
import re
import subprocess
import sys
import types

import pytest

import gradspec
import gradspec.training

# The core and the recipes, by the module that defines them (what each name must resolve to).
CORE_BY_MODULE = {
    "gradspec.runs.api": ("score", "align"),
    "gradspec.runs.score_files": ("read_scores", "iter_scores", "read_metadata"),
    "gradspec.runs.checkpoint_sum": ("sum_over_checkpoints",),
    "gradspec.training.monitor_parts": ("read_monitor",),
    "gradspec.engine.spectral_engine": ("SpectralEngine", "BatchScores"),
    "gradspec.training.monitor": ("SpectralMonitor",),
    "gradspec.training.monitor_callback": ("SpectralMonitorCallback",),
    "gradspec.layers.registry": ("register_layer_kind", "Target", "Part"),
    "gradspec.layers.linear": ("linear_target",),
    "gradspec.linalg.metrics": ("register_metric",),
    "gradspec.data.readers": ("Fields",),
    "gradspec.errors": ("InputError",),
    "gradspec.options": ("OptionError",),
    "gradspec.files.locks": ("RunLocked",),
}
TRAINING_BY_MODULE = {
    "gradspec.training.wit": ("WITCollator", "WITLoss", "use_wit_loss", "wit_loss"),
    "gradspec.training.sample_index": ("with_sample_index", "keep_sample_index"),
    "gradspec.training.sftmix": ("SFTMixTrainer",),
    "gradspec.training.dynamics": ("DynamicsCallback",),
    "gradspec.data.models": ("load_model",),
}
CORE = {name: module for module, names in CORE_BY_MODULE.items() for name in names}
TRAINING = {name: module for module, names in TRAINING_BY_MODULE.items() for name in names}
MOVED_TO_TRAINING = ("WITCollator", "WITLoss", "use_wit_loss", "wit_loss", "with_sample_index", "keep_sample_index",
                     "SFTMixTrainer", "DynamicsCallback")


def _defined(module: str, name: str):
    return getattr(importlib.import_module(module), "register" if name == "register_layer_kind" else name)


def test_gradspec_exports_exactly_the_core():
    assert sorted(gradspec.__all__) == sorted(["__version__", *CORE])
    assert len(gradspec.__all__) == len(set(gradspec.__all__))
    for name, module in CORE.items():
        assert getattr(gradspec, name) is _defined(module, name), name
    assert set(gradspec.__all__) <= set(dir(gradspec)) and not set(MOVED_TO_TRAINING) & set(dir(gradspec))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        gradspec.nothing  # noqa: B018


def test_gradspec_training_exports_the_recipes():
    assert sorted(gradspec.training.__all__) == sorted(TRAINING)
    for name, module in TRAINING.items():
        assert getattr(gradspec.training, name) is _defined(module, name), name
    from gradspec.training import SFTMixTrainer, WITCollator  # noqa: F401  (the docs' imports)


@pytest.mark.parametrize("name", MOVED_TO_TRAINING)
def test_a_recipe_at_the_top_still_resolves_for_one_release_with_a_warning(name):
    with pytest.warns(DeprecationWarning, match=rf"gradspec\.{name} is deprecated .*use gradspec\.training\.{name}$"):
        old = getattr(gradspec, name)
    assert old is getattr(gradspec.training, name) and name not in gradspec.__all__
    with pytest.warns(DeprecationWarning, match=f"use gradspec.training.{name}"):
        exec(f"from gradspec import {name}", {})


def test_metrics_at_the_top_warns_and_says_where_the_columns_are_named():
    from gradspec.linalg.metrics import METRICS

    with pytest.warns(DeprecationWarning, match=r"gradspec\.METRICS is deprecated.*metric_names.*read_metadata"):
        assert gradspec.METRICS is METRICS
    assert "METRICS" not in gradspec.__all__


def test_gradspec_environment_is_the_module_and_calling_it_still_works_for_one_release(monkeypatch):
    """The module and its function no longer share a name: gradspec.environment is the module, whatever
    was imported; calling it (what gradspec.environment() did) runs the function, with a warning."""
    module = importlib.import_module("gradspec.environment")
    assert gradspec.environment is module and isinstance(module, types.ModuleType)
    assert inspect.isfunction(module.environment) and "environment" not in gradspec.__all__
    monkeypatch.setattr(module, "environment", lambda: {"python": "3"})
    with pytest.warns(DeprecationWarning, match=r"call gradspec\.environment\.environment\(\)"):
        assert gradspec.environment() == {"python": "3"}


def test_import_gradspec_does_not_load_the_trainer():
    """The training classes load transformers' Trainer on first use only (the CLI starts faster)."""
    code = "import sys, gradspec; print('transformers.trainer' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_the_version_is_the_one_score_files_record():
    from importlib.metadata import version

    import gradspec

    assert gradspec.__version__ == version("gradspec") and "__version__" in gradspec.__all__


# Docstrings: the public API's are Google style. score and align (gradspec.runs.api) and Fields and
# InputError (gradspec.data) are documented where they live, by their own change; so is load_model
# (gradspec.data.models: its parameters are described in prose, its Args: section is that module's change).
DOCUMENTED_ELSEWHERE = {"score", "align", "Fields", "InputError", "load_model"}


def _section(doc: str | None, name: str) -> list[str] | None:
    """The lines of a docstring's section (None where it has none), dedented."""
    lines = inspect.cleandoc(doc or "").splitlines()
    if f"{name}:" not in lines:
        return None
    body = []
    for line in lines[lines.index(f"{name}:") + 1:]:
        if line.strip() and not line.startswith(" "):  # back at the docstring's own indent: the next section
            break
        body.append(line)
    return inspect.cleandoc("\n".join(body)).splitlines()


def _documented_args(doc: str | None) -> set[str]:
    """The names the Args section documents: its entries, "name: ..." or "name (type): ..."."""
    entries = _section(doc, "Args") or []
    return {m.group(1) for line in entries if (m := re.match(r"\*{0,2}(\w+)\s*(?:\(.*\))?:", line))}


def _problems(where: str, fn, doc: str | None, skip_first: bool) -> list[str]:
    """What fn's docstring (a class's: its constructor's) leaves out: named parameters, a Returns:."""
    if not (doc or "").strip():
        return [f"{where}: no docstring"]
    signature = inspect.signature(fn)
    params = list(signature.parameters.values())[1 if skip_first else 0:]
    wanted = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    out = [f"{where}: {name} not under Args:" for name in wanted if name not in _documented_args(doc)]
    returns = signature.return_annotation
    if not inspect.isclass(fn) and returns not in (inspect.Signature.empty, None, "None") \
            and _section(doc, "Returns") is None and _section(doc, "Yields") is None:
        out.append(f"{where}: returns something (annotated) but has no Returns:")
    return out


def _public_methods(cls) -> list[tuple[str, object, bool]]:
    """(name, function or property, whether its first parameter is self or cls) for what a class
    defines itself (not inherited): its public methods and properties, and __call__."""
    out = []
    for name, attr in vars(cls).items():
        if name.startswith("_") and name != "__call__":
            continue
        if isinstance(attr, staticmethod | classmethod):
            out.append((name, attr.__func__, isinstance(attr, classmethod)))
        elif inspect.isfunction(attr) or isinstance(attr, property):
            out.append((name, attr, inspect.isfunction(attr)))
    return out


def api_docstring_problems() -> list[str]:
    """Those of gradspec's names and gradspec.training's; an error's docstring only (a caller catches
    it, gradspec raises it)."""
    problems = []
    public = [(name, getattr(gradspec, name)) for name in gradspec.__all__]
    for name, obj in public + [(name, getattr(gradspec.training, name)) for name in gradspec.training.__all__]:
        if name in DOCUMENTED_ELSEWHERE or not callable(obj):
            continue
        if inspect.isclass(obj) and issubclass(obj, Exception):
            problems += [] if (obj.__doc__ or "").strip() else [f"{name}: no docstring"]
            continue
        if not inspect.isclass(obj):
            problems += _problems(name, obj, obj.__doc__, skip_first=False)
            continue
        problems += _problems(name, obj, obj.__doc__, skip_first=False)  # the constructor's Args
        for method, attr, bound in _public_methods(obj):
            where = f"{name}.{method}"
            if isinstance(attr, property):
                problems += [] if (attr.fget.__doc__ or "").strip() else [f"{where}: no docstring"]
            else:
                problems += _problems(where, attr, attr.__doc__, skip_first=bound)
    return problems


def test_the_public_api_documents_its_parameters_and_returns():
    """Every public function, class (its constructor) and method: each parameter under Args:, a
    Returns: (Yields: for a generator) where the return annotation is not None."""
    problems = api_docstring_problems()
    assert not problems, "\n".join(problems)


def test_the_docstring_check_reads_google_sections():
    def documented(a: int, *args, b: int = 0, **kwargs) -> int:
        """Why.

        Args:
            a: One.
            b (int): Two,
                on two lines.

        Returns:
            Three.
        """

    def undocumented(a: int, b: int) -> int:
        """Why.

        Args:
            a: One; b is not an entry.
        """

    assert _problems("documented", documented, documented.__doc__, skip_first=False) == []
    assert _problems("undocumented", undocumented, undocumented.__doc__, skip_first=False) == [
        "undocumented: b not under Args:", "undocumented: returns something (annotated) but has no Returns:"]


def test_import_gradspec_is_light():
    """The public names load on first use: `import gradspec` (and so the command line, before it knows
    its command) and `import gradspec.training` load neither torch, pandas nor transformers."""
    code = ("import sys, gradspec, gradspec.training\n"
            "print(sorted({'torch', 'pandas', 'transformers'} & set(sys.modules)))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_public_names_stay_what_they_are_whatever_is_imported():
    """No public name is also a sub-package's: importing gradspec.<name> would replace the function."""
    import importlib
    import pkgutil
    import types

    for module in pkgutil.iter_modules(gradspec.__path__, "gradspec."):
        if module.name != "gradspec.__main__":  # that one runs the command line
            importlib.import_module(module.name)
    for name in gradspec.__all__:
        assert not isinstance(getattr(gradspec, name), types.ModuleType), name
