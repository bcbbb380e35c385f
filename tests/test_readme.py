"""The README's code blocks run as written."""

import re
from pathlib import Path

import pytest

README = (Path(__file__).parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_has_code_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_block_runs(i, capsys):
    namespace: dict = {}
    exec(compile(BLOCKS[i], f"README.md block {i}", "exec"), namespace)
    if "w" in namespace and "b" in namespace and i == 0:
        assert abs(namespace["w"].item() - 2.0) < 0.05
        assert abs(namespace["b"].item() - 1.0) < 0.1
    if "params" in namespace:
        assert abs(float(namespace["params"]["w"]) - 2.0) < 0.05
        assert abs(float(namespace["params"]["b"]) - 1.0) < 0.1
