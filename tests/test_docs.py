"""The documentation site's sources are complete (the site itself: `make docs`).

Building the site takes mkdocs and a while, so it is `make docs` (strict) in CI, not a
test. What is checked here, from the sources alone: every name in every package's
``__all__`` appears in that package's API page, with its ``::: entrenar.<pkg>``
block; every spec, example and benchmark result is included by a page; the README
sections the getting-started page includes exist; and the generated pages are what
docs/gen_pages.py writes now.
"""

import importlib
import importlib.util
import os
import pkgutil
import re

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
