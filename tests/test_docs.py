"""Every fenced code block in README.md and docs/*.md runs here, or says why it does not; every
relative link in them leads to a file and heading that exist.

Which blocks run
- ```bash and ```python blocks run. The blocks of one page run in page order, in one fresh folder
  per page (a reader who runs a page top to bottom gets the same files); each python block is
  exec'd with fresh globals.
- ```text blocks are output, layouts and file trees: never run, no marker needed.
- ``<!-- not run: REASON -->`` on the line just before a fence skips that block. The reason is
  required. Markers are for what this machine cannot do: a GPU, torchrun or several nodes, a Slurm
  array.
- ``<!-- file: NAME -->`` on the line just before a fence: the block is the content of the file NAME,
  written into the page's folder when the page reaches it (not run; any language).
- This test fails on any other block (another language, or none) without a marker, on a marker
  without a reason or not followed by a fence, and on a bash command it cannot run.

How commands are run, and the only ways they are adapted
- A bash block is split into commands: backslash continuations are joined, ``#`` comments dropped,
  new lines and ``&&`` separate commands. ``gradspec ...``, ``.venv/bin/gradspec ...`` and
  ``python -m gradspec ...`` run in-process through ``gradspec.cli.main(argv)`` and must return 0
  (an argparse exit counts as its code). ``bash .ci/setup`` and ``.venv/bin/pytest -q`` (the README's
  set-up and test commands) are what CI itself runs (.ci/run) around this test: taken as done. Any
  other program fails the test unless its block is marked.
- The default model is a tiny random Llama (conftest's ``tiny_model_dir``: 2 layers, SmolLM2's
  tokenizer): $GRADSPEC_CACHE points at a folder whose SmolLM2-135M-Instruct is that model, so the
  commands and python blocks that use the default model (``load_model()``, no ``--model``) load it.
- Each value of ``--model``, ``--base`` and ``--checkpoints`` (``MODEL_OPTIONS``) that is not a path
  in the page's folder (a Hub id such as Qwen/Qwen3-30B-A3B, a placeholder such as FINETUNED or
  ckpt-1000) is replaced by a tiny model: conftest's ``tiny_moe_dir`` (a tiny Qwen3-MoE) where
  ``--modules`` names experts or router, else the tiny Llama. A path the page made (run/model) stays.
- Inputs: each page's folder starts with ``INPUT_FILES`` (8 Alpaca rows each; task.jsonl 3). A
  ``--data`` or ``--target`` (``INPUT_OPTIONS``) naming another missing .jsonl/.json/.parquet file
  is written from the same rows; a Hub dataset name (org/name) becomes a local folder of that name,
  laid out as a Hub repository with the split ``--split`` names (default train), so nothing is
  downloaded.
- A command that would score all 164 HumanEval rows (score, align, project, train, dynamics or
  diagnose without ``--data``, ``--config``, ``--store`` or ``--limit``) gets ``--limit 4``, and a
  ``--limit`` above 4 is lowered to 4 (the inputs here have 8 rows).
- What python blocks register (a layer kind, a metric) is unregistered after the page.
"""

from __future__ import annotations

import json
import random
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from gradspec.cli import main
from gradspec.data.hub import is_dataset_name
from gradspec.data.models import DEFAULT_MODEL
from gradspec.layers import registry
from gradspec.linalg import metrics

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"bash", "python"}
NOT_CODE = {"text"}
MARKER = re.compile(r"^<!--\s*(not run|file)\b\s*:?\s*(.*?)\s*-->$")
FENCE = re.compile(r"^(```+)\s*([\w+-]*)\s*$")

MODEL_OPTIONS = ("--model", "--base", "--checkpoints")
CI_ITSELF = (["bash", ".ci/setup"], [".venv/bin/pytest", "-q"])  # the README's set-up and test commands: .ci/run
INPUT_OPTIONS = ("--data", "--target")
SCORING = {"score", "align", "project", "train", "dynamics", "diagnose"}
INPUT_FILES = ("data.jsonl", "my.jsonl", "other.jsonl", "train.jsonl", "pool.jsonl", "big.jsonl", "high.jsonl",
               "low.jsonl", "held_out.jsonl")
TASK_FILE = "task.jsonl"
LIMIT = 4  # rows a HumanEval run scores here, and the most any --limit asks for

# Alpaca rows of varied lengths; each input file takes its own 8 of them.
ROWS = [
    {"instruction": "What is 2+2?", "output": "4"},
    {"instruction": "What is 7 times 6?", "output": "7 times 6 is 42."},
    {"instruction": "Name a colour.", "output": "Blue, like the sky on a clear summer day."},
    {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour."},
    {"instruction": "Write a haiku about the sea.",
     "output": "Waves fold into foam,\nsalt wind carries gulls away,\nthe tide keeps its time."},
    {"instruction": "Give a synonym of quick.", "output": "Fast."},
    {"instruction": "Sum the list.", "input": "[1, 2, 3, 4]", "output": "The sum is 10."},
    {"instruction": "Explain what a prime number is.",
     "output": "A prime number is a whole number greater than 1 whose only divisors are 1 and itself, "
               "such as 2, 3, 5 and 7."},
    {"instruction": "Reverse the word.", "input": "gradient", "output": "tneidarg"},
    {"instruction": "What is the capital of Italy?", "output": "Rome is the capital of Italy."},
    {"instruction": "Write a Python function that squares a number.", "output": "def square(x):\n    return x * x"},
    {"instruction": "Is 17 even?", "output": "No, 17 is odd."},
]


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    marker: str | None  # "not run" or "file"
    reason: str  # the marker's reason, or the file's name

    def __str__(self) -> str:
        return f"{_name(self.page)}:{self.line} ({self.language or 'no language'})"


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


def blocks(page: Path) -> list[Block]:
    """The page's fenced blocks; raises AssertionError on a malformed marker or an unclosed fence."""
    lines = page.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        marker = MARKER.match(lines[i].strip())
        if marker:
            assert i + 1 < len(lines) and FENCE.match(lines[i + 1]), \
                f"{_name(page)}:{i + 1}: a marker must be on the line just before a fence"
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence[1]), None)
        assert end is not None, f"{_name(page)}:{i + 1}: unclosed fence"
        before = MARKER.match(lines[i - 1].strip()) if i else None
        found.append(Block(page, i + 1, fence[2], "\n".join(lines[i + 1:end]) + "\n",
                           before[1] if before else None, before[2] if before else ""))
        i = end + 1
    return found


def _problem(block: Block) -> str | None:
    """Why a block can neither run nor be skipped, or None."""
    if block.marker is not None and not block.reason:
        return f"{block}: a '{block.marker}' marker needs a reason (or a file name): <!-- {block.marker}: ... -->"
    if block.marker is None and block.language not in RUN | NOT_CODE:
        return f"{block}: cannot run a '{block.language}' block; use ```text, or mark it <!-- not run: why -->"
    return None


# --- the page's folder --------------------------------------------------------------------------------------------


def _write_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        pd.DataFrame(rows).to_parquet(path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _rows_for(name: str, n: int = 8) -> list[dict]:
    return random.Random(name).sample(ROWS, n)


def _hub_folder(path: Path, split: str, config_name: str | None) -> None:
    """A local folder laid out as a Hub dataset repository, whose README names the split."""
    (path / "data").mkdir(parents=True)
    _write_rows(path / f"data/{split}.jsonl", _rows_for(str(path)))
    (path / "README.md").write_text(
        f"---\nconfigs:\n- config_name: {config_name or 'default'}\n  data_files:\n  - split: {split}\n"
        f"    path: data/{split}.jsonl\n---\n")


def _values(argv: list[str], option: str) -> list[tuple[int, str]]:
    """(index, value) of each value given to option (--option V, --option=V, --checkpoints A B ...)."""
    out = []
    for i, token in enumerate(argv):
        if token.startswith(option + "="):
            out.append((i, token.split("=", 1)[1]))
        elif token == option:
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                out.append((j, argv[j]))
                j += 1
                if option != "--checkpoints":
                    break
    return out


def _adapted(argv: list[str], folder: Path, tiny: dict[str, Path]) -> list[str]:
    """The command's arguments as this test runs them (see the module's docstring)."""
    argv = list(argv)
    command = argv[0] if argv else ""
    modules = ",".join(v for _, v in _values(argv, "--modules"))
    model = tiny["moe"] if re.search(r"experts|router", modules) else tiny["llama"]
    for option in MODEL_OPTIONS:
        for i, value in _values(argv, option):
            if not (folder / value).exists():
                argv[i] = argv[i].replace(value, str(model)) if argv[i] != value else str(model)
    split = next((v for _, v in _values(argv, "--split")), "train")
    config_name = next((v for _, v in _values(argv, "--config-name")), None)
    for option in INPUT_OPTIONS:
        for _, value in _values(argv, option):
            path = folder / value
            if path.exists():
                continue
            if path.suffix in (".jsonl", ".json", ".parquet"):
                _write_rows(path, _rows_for(value))
            elif is_dataset_name(value):
                _hub_folder(path, split, config_name)
    for i, value in _values(argv, "--limit"):
        if int(value) > LIMIT:
            argv[i] = argv[i].replace(value, str(LIMIT)) if argv[i] != value else str(LIMIT)
    if command in SCORING and not any(_values(argv, o) or o in argv
                                      for o in ("--data", "--config", "--store", "--limit")):
        argv += ["--limit", str(LIMIT)]
    return argv


def _commands(code: str) -> list[list[str]]:
    """A bash block's commands, each as its tokens."""
    joined = re.sub(r"\\\n", " ", code)
    commands = []
    for line in joined.split("\n"):
        tokens = shlex.split(line, comments=True)
        while tokens:
            cut = tokens.index("&&") if "&&" in tokens else len(tokens)
            commands.append(tokens[:cut])
            tokens = tokens[cut + 1:]
    return [c for c in commands if c]


def _gradspec_argv(tokens: list[str]) -> list[str] | None:
    if tokens[0] in ("gradspec", ".venv/bin/gradspec"):
        return tokens[1:]
    if tokens[0] in ("python", "python3", ".venv/bin/python") and tokens[1:3] == ["-m", "gradspec"]:
        return tokens[3:]
    return None


def _run_bash(block: Block, folder: Path, tiny: dict[str, Path]) -> None:
    for tokens in _commands(block.code):
        if tokens in CI_ITSELF:
            continue  # what .ci/run does before and around this test
        argv = _gradspec_argv(tokens)
        assert argv is not None, f"{block}: cannot run {shlex.join(tokens)!r} here; mark the block " \
                                 "<!-- not run: why --> if it needs what this machine lacks"
        argv = _adapted(argv, folder, tiny)
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        assert code == 0, f"{block}: `gradspec {shlex.join(argv)}` exited {code}"


def _run_python(block: Block) -> None:
    exec(compile(block.code, str(block), "exec"), {"__name__": "__docs__"})  # noqa: S102


# --- the tests ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tiny_model_dir, tiny_moe_dir):
    """The tiny models, and a cache folder whose default model is the tiny Llama."""
    cache = tmp_path_factory.mktemp("gradspec-cache")
    shutil.copytree(tiny_model_dir, cache / DEFAULT_MODEL)
    return {"llama": Path(tiny_model_dir), "moe": Path(tiny_moe_dir), "cache": cache}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_block_runs_or_says_why_not(page, tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("GRADSPEC_CACHE", str(tiny_models["cache"]))
    monkeypatch.setattr(registry, "LAYER_KINDS", list(registry.LAYER_KINDS))
    monkeypatch.setattr(metrics, "_METRICS", dict(metrics._METRICS))
    monkeypatch.chdir(tmp_path)
    for name in INPUT_FILES:
        _write_rows(tmp_path / name, _rows_for(name))
    _write_rows(tmp_path / TASK_FILE, _rows_for(TASK_FILE, 3))
    for block in blocks(page):
        problem = _problem(block)
        assert problem is None, problem
        if block.marker == "file":
            (tmp_path / block.reason).write_text(block.code)
        elif block.marker is None and block.language == "bash":
            _run_bash(block, tmp_path, tiny_models)
        elif block.marker is None and block.language == "python":
            _run_python(block)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # headings outside code
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_link_leads_somewhere(page):
    text = re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S))
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.relative_to(ROOT)}: link to {target}: no such file"
        if anchor:
            assert file.suffix == ".md" and anchor in _anchors(file), \
                f"{page.relative_to(ROOT)}: link to {target}: no such heading"


def test_the_readme_links_every_page():
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


def test_the_rules_catch_what_they_should(tmp_path):
    """A marker without a reason, a marker away from its fence, and an unmarked block of another language."""
    page = tmp_path / "page.md"
    page.write_text("<!-- not run: -->\n```bash\nx\n```\n\n```yaml\na: 1\n```\n\n<!-- not run: GPU -->\n```cuda\n```\n")
    problems = [_problem(block) for block in blocks(page)]
    assert "needs a reason" in problems[0] and "cannot run a 'yaml'" in problems[1] and problems[2] is None
    (tmp_path / "orphan.md").write_text("<!-- not run: GPU -->\n\n```bash\n```\n")
    with pytest.raises(AssertionError, match="just before a fence"):
        blocks(tmp_path / "orphan.md")
