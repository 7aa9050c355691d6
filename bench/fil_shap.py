#!/usr/bin/env python3
"""FIL backend: what `treeshap_output` (SHAP values) costs per row next to plain prediction.

Three models with a `treeshap_output`, served through the in-process Server API (`Server.infer`, no network):
an XGBoost and a LightGBM binary classifier (their libraries' own TreeSHAP: `pred_contribs` / `pred_contrib`) and a
scikit-learn random forest regressor as a Treelite checkpoint (Naiad's TreeSHAP over the Treelite trees, numpy).
Each request carries `--rows` rows; a round sends requests one after another for `--seconds`, asking either for
`output__0` alone (plain prediction) or for `output__0` and `treeshap_output`. Rounds alternate the two so both see
the same background load; cells show the median round and the best one (other work only ever slows a round).

    .venv/bin/python bench/fil_shap.py                      # 3 rounds x 2 s, 256-row requests
    .venv/bin/python bench/fil_shap.py --rows 1 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "server"))

import lightgbm as lgb  # noqa: E402
import numpy as np  # noqa: E402
import treelite.sklearn  # noqa: E402
import xgboost as xgb  # noqa: E402
from sklearn import ensemble  # noqa: E402

from naiad.inference import InferenceRequest, RequestedOutput  # noqa: E402
from naiad.server import Server, ServerOptions  # noqa: E402

FEATURES = 16
ROWS = np.random.default_rng(1).normal(size=(8192, FEATURES)).astype(np.float32)


def write(root: Path, name: str, filename: str, save, params: dict, shap_dims: str) -> None:
    vdir = root / name / "1"
    vdir.mkdir(parents=True)
    save(str(vdir / filename))
    lines = [
        'backend: "fil"',
        "max_batch_size: 4096",
        f'input [ {{ name: "input__0" data_type: TYPE_FP32 dims: [ {FEATURES} ] }} ]',
        'output [ { name: "output__0" data_type: TYPE_FP32 dims: [ 1 ] },',
        f'  {{ name: "treeshap_output" data_type: TYPE_FP32 dims: [ {shap_dims} ] }} ]',
        "instance_group [ { count: 1 kind: KIND_CPU } ]",
        *(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in params.items()),
    ]
    (root / name / "config.pbtxt").write_text("\n".join(lines))


def write_repo(root: Path, trees: int) -> dict[str, str]:
    """The models, and a line describing each."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20_000, FEATURES)).astype(np.float32)
    y = (x[:, :4].sum(axis=1) + 0.3 * rng.normal(size=len(x)) > 0).astype(int)
    f1 = str(FEATURES + 1)
    xb = xgb.XGBClassifier(n_estimators=trees, max_depth=6, n_jobs=os.cpu_count()).fit(x, y)
    write(root, "xgb", "xgboost.json", xb.get_booster().save_model, {"model_type": "xgboost_json"}, f1)
    lb = lgb.LGBMClassifier(n_estimators=trees, num_leaves=63, verbose=-1).fit(x, y)
    write(root, "lgb", "model.txt", lb.booster_.save_model, {"model_type": "lightgbm"}, f1)
    forest_trees = max(1, trees // 5)
    rf = ensemble.RandomForestRegressor(n_estimators=forest_trees, max_depth=6, random_state=0, n_jobs=-1)
    rf.fit(x[:5000], x[:5000, 0] * 2 - x[:5000, 3])
    tl = treelite.sklearn.import_model(rf)
    write(root, "sklearn_rf", "checkpoint.tl", tl.serialize, {"model_type": "treelite_checkpoint"}, f1)
    return {
        "xgb": f"XGBoost binary, {trees} trees of depth 6 (pred_contribs)",
        "lgb": f"LightGBM binary, {trees} trees of 63 leaves (pred_contrib)",
        "sklearn_rf": f"scikit-learn random forest, {forest_trees} trees of depth 6, Treelite (Naiad's TreeSHAP)",
    }


async def rows_per_second(server: Server, model: str, rows: int, seconds: float, shap: bool) -> float:
    outputs = [RequestedOutput("output__0")] + ([RequestedOutput("treeshap_output")] if shap else [])
    done, i = 0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or done == 0:
        x = ROWS[(i * rows) % (len(ROWS) - rows) :][:rows]
        req = InferenceRequest(model, {"input__0": x}, {"input__0": "FP32"}, outputs=list(outputs))
        resp = await server.infer(req)
        assert resp.error is None, resp.error
        assert len(resp.outputs) == len(outputs)
        done += rows
        i += 1
    return done / (time.perf_counter() - start)


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="naiad-fil-shap-") as tmp:
        described = write_repo(Path(tmp), args.trees)
        server = Server(ServerOptions(model_repositories=[tmp]))
        await server.start()
        try:
            print(
                f"{args.rows}-row requests, {args.rounds} rounds x {args.seconds:g} s each way, "
                f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
                flush=True,
            )
            print(
                f"{'model':<11} {'predict us/row':>22} {'predict+SHAP us/row':>22} {'SHAP costs':>11}",
                flush=True,
            )
            for model, line in described.items():
                await rows_per_second(
                    server, model, args.rows, 0.3, True
                )  # warm up (Treelite reads its trees)
                plain, shap = [], []
                for _ in range(args.rounds):
                    plain.append(await rows_per_second(server, model, args.rows, args.seconds, False))
                    shap.append(await rows_per_second(server, model, args.rows, args.seconds, True))
                p_us = [1e6 / r for r in plain]
                s_us = [1e6 / r for r in shap]
                ratio = statistics.median(s_us) / statistics.median(p_us)
                print(
                    f"{model:<11} {statistics.median(p_us):>11.2f} (best {min(p_us):6.2f}) "
                    f"{statistics.median(s_us):>11.2f} (best {min(s_us):6.2f}) {ratio:>10.1f}x   {line}",
                    flush=True,
                )
        finally:
            await server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=256, help="rows per request")
    parser.add_argument(
        "--trees", type=int, default=100, help="boosted trees (the random forest has a fifth)"
    )
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
