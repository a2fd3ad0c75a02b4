"""The public API stays importable from gradspec as the README documents it."""

import inspect
import re
import subprocess
import sys

import gradspec


def test_every_public_name_is_importable_from_gradspec():
    for name in gradspec.__all__:
        assert getattr(gradspec, name) is not None, name
    from gradspec import SpectralMonitor, SpectralMonitorCallback, WITCollator  # noqa: F401  (the README's imports)


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
# InputError (gradspec.data) are documented where they live, by their own change.
DOCUMENTED_ELSEWHERE = {"score", "align", "Fields", "InputError"}


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
    problems = []
    for name in gradspec.__all__:
        obj = getattr(gradspec, name)
        if name in DOCUMENTED_ELSEWHERE or not callable(obj):
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
    its command) loads neither torch, pandas nor transformers."""
    code = "import sys, gradspec; print(sorted({'torch', 'pandas', 'transformers'} & set(sys.modules)))"
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
