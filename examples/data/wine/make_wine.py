"""Write the UCI Wine recognition data as train/validation Parquet files.

Source: the copy of the UCI Wine data that scikit-learn ships
(``sklearn/datasets/data/wine_data.csv``): 178 wines, 13 chemical measurements, the
cultivar (0, 1, 2) as the target. Split 80/20, stratified by cultivar, seed 0.
Run: ``python examples/data/wine/make_wine.py`` (needs scikit-learn and pyarrow).
"""

from __future__ import annotations

import csv
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import sklearn.datasets

COLUMNS = [
    "alcohol",
    "malic_acid",
    "ash",
    "alcalinity_of_ash",
    "magnesium",
    "total_phenols",
    "flavanoids",
    "nonflavanoid_phenols",
    "proanthocyanins",
    "color_intensity",
    "hue",
    "od280_od315",
    "proline",
]
HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    src = os.path.join(
        os.path.dirname(sklearn.datasets.__file__), "data", "wine_data.csv"
    )
    with open(src, newline="") as f:
        rows = list(csv.reader(f))[1:]  # the first line is "178,13,class_0,..."
    x = np.array([[float(v) for v in r[:13]] for r in rows])
    y = np.array([int(r[13]) for r in rows])
    rng = np.random.default_rng(0)
    valid = np.zeros(len(y), bool)
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        valid[idx[: round(0.2 * len(idx))]] = True
    for name, keep in (("train", ~valid), ("validation", valid)):
        order = rng.permutation(np.flatnonzero(keep))
        table = {c: pa.array(x[order, j]) for j, c in enumerate(COLUMNS)}
        table["cultivar"] = pa.array(y[order].astype(np.int64))
        pq.write_table(pa.table(table), os.path.join(HERE, f"{name}.parquet"))
        print(f"{name}.parquet: {len(order)} rows")


if __name__ == "__main__":
    main()
