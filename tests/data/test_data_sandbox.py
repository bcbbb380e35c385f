"""Hostile chat templates: refused within a budget as a TemplateError, exit code 2."""

from __future__ import annotations

import time
import tracemalloc

import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from entrenar.cli.app import EXIT_USAGE, exit_code
from entrenar.data import render_chat, sandbox
from entrenar.errors import TemplateError
from entrenar.io import read_gguf, smollm2_path

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
]


def test_nested_loops_stop_at_the_step_budget(deadline):
    t = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"
    with deadline(20), pytest.raises(TemplateError, match="more than 1,000,000"):
        render_chat(CHAT, t)


def test_a_slow_template_stops_at_the_time_budget(monkeypatch, deadline):
    monkeypatch.setattr(sandbox, "MAX_SECONDS", 0.2)
    fib = (
        "{% macro f(n) %}{% if n > 1 %}{{ f(n - 1) }}{{ f(n - 2) }}{% endif %}"
        "{% endmacro %}{{ f(60) }}"
    )
    start = time.perf_counter()
    with deadline(20), pytest.raises(TemplateError, match=r"more than 0\.2 s"):
        render_chat(CHAT, fib)
    assert time.perf_counter() - start < 2


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{{ range(1000000) | length }}", "more than 10,000 numbers"),
        ("{{ range(10 ** 30) | length }}", "more than 10,000 numbers"),
        ("{{ 'a\\nb' | indent(10 ** 9) }}", "indent would make"),
        ("{{ 'a' | center(10 ** 9) }}", "center would make"),
        ("{{ messages | tojson(indent=1000000) }}", "tojson would make"),
        ("{{ 'a' * 10 ** 9 }}", r"the \* operator would make"),
        ("{{ [1] * 10 ** 9 }}", r"the \* operator would make"),
        ("{{ 10 ** 100000 }}", r"over 10\*\*4300"),
        ("{{ 'x'.ljust(10 ** 9) }}", "str.ljust would make"),
        ("{{ '{:>999999999}'.format('x') }}", "width or precision"),
        ("{{ '%999999999s' % 'x' }}", "width or precision"),
        ("{{ '%999999999s' | format('x') }}", "width or precision"),
        ("{{ ('x' * 10 ** 6) | replace('', 'yyyyyyyyyy') }}", "replace would make"),
        ("{% set b = 'x' * 10 ** 6 %}{{ ([b] * 100) | join }}", "join would make"),
        ("{{ messages | slice(10 ** 8) | list }}", "at most 10,000"),
        ("{{ lipsum(10 ** 7) }}", "'lipsum' is undefined"),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
            "~ would make",
        ),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
            "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
            r"the \+ operator would make",
        ),
    ],
)
def test_templates_that_would_exhaust_memory_are_refused_first(
    template, match, deadline
):
    with deadline(20), pytest.raises(TemplateError, match=match):
        render_chat(CHAT, template)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ('%999999s' * 1000) % ((1,) * 1000) }}",
        "{{ ('{:999999}' * 1000).format(*([1] * 1000)) }}",
        "{{ ('%999999s' * 1000) | format(*([1] * 1000)) }}",
        "{{ '%*s' % (999999999, 'x') }}",
        "{{ '%-*d' | format(999999999, 1) }}",
        "{{ '{0:{1}}'.format('x', 999999999) }}",
        "{{ '{:>{w}}'.format_map({'w': 999999999}) }}",
    ],
)
def test_format_widths_are_added_up_before_formatting(template, deadline):
    """Widths under a million each, or taken from the arguments, add up.

    Before, a gigabyte was built before the result's size was checked.
    """
    tracemalloc.start()
    try:
        with deadline(20), pytest.raises(TemplateError, match="would make"):
            render_chat(CHAT, template)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20
    assert render_chat(CHAT, "{{ '%d %5s|{:>4}' % (2024, 'x') }}") == "2024     x|{:>4}"


@pytest.mark.parametrize("tag", ["include 'x'", "import 'x' as y", "extends 'x'"])
def test_loading_other_templates_is_refused_with_its_line(tag):
    with pytest.raises(TemplateError, match=r"line 2: \{% (include|import|extends)"):
        render_chat(CHAT, "hi\n{% " + tag + " %}")


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion too"),
        ("{% for m in [1] recursive %}{{ loop([1]) }}{% endfor %}", "recursion too"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{{ '%d' | format('x') }}", "TypeError"),
        ("{{ " + "9" * 5000 + " }}", "cannot compile"),
    ],
)
def test_failing_templates_are_template_errors(template, match, deadline):
    with deadline(20), pytest.raises(TemplateError, match=match):
        render_chat(CHAT, template)


LOOPS = """{% for m in messages if m.role != 'system' %}
{{ loop.index }}/{{ loop.length }} {{ loop.cycle('a', 'b') }}{{ loop.last }}
{{ m.role ~ ': ' ~ m.content | indent(2) | center(20) }}
{% for k, v in m | dictsort %}{{ k }}={{ v | tojson }};{% endfor %}
{% else %}none{% endfor %}
{{ messages | map(attribute='content') | join(' | ') }} {{ range(3) | list }}
{{ '%s-%03d' | format('x', 7) }} {{ '{}!'.format(2 ** 10) }} {{ [1, 2] * 2 }}
{{ messages | tojson(indent=2) }} {{ 'a b c' | replace(' ', '_') }}"""


@pytest.mark.parametrize("name", ["loops", "smollm2"])
def test_templates_render_exactly_as_in_the_plain_sandbox(name):
    if name == "smollm2":
        template = read_gguf(smollm2_path()).metadata["tokenizer.chat_template"]
    else:
        template = LOOPS
    plain = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    plain.filters["tojson"] = sandbox.tojson
    for gen in (False, True):
        want = plain.from_string(template).render(
            messages=CHAT, add_generation_prompt=gen
        )
        assert render_chat(CHAT, template, add_generation_prompt=gen) == want


def test_the_command_line_exits_2_on_a_template_error():
    assert exit_code(TemplateError("chat template: 1/0")) == EXIT_USAGE
