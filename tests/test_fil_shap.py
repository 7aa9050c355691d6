"""The fil backend's `treeshap_output` (Triton FIL's SHAP values), served by `naiad serve` and compared with the
libraries' own: XGBoost `pred_contribs`, LightGBM `pred_contrib`, shap's TreeExplainer on the scikit-learn model."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightgbm as lgb
import numpy as np
import pytest
import shap
import treelite.sklearn
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import xgboost as xgb
from helpers import NaiadProcess
from sklearn import ensemble
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.filterwarnings("ignore:.*Saving model in the UBJSON format as default")

FEATURES = 5
rng = np.random.default_rng(11)
X_TRAIN = rng.normal(size=(500, FEATURES)).astype(np.float32)
Y_BINARY = (X_TRAIN[:, 0] + 0.5 * X_TRAIN[:, 1] - X_TRAIN[:, 4] > 0).astype(int)
Y_MULTI = (X_TRAIN[:, 0] > 0.4).astype(int) + (X_TRAIN[:, 2] > 0).astype(int)  # 3 classes
Y_REG = X_TRAIN[:, 0] * 2.0 - X_TRAIN[:, 3] + X_TRAIN[:, 1] * X_TRAIN[:, 2]
X_TEST = rng.normal(size=(41, FEATURES)).astype(np.float32)
X_MISSING = X_TEST.copy()
X_MISSING[::4, 1] = np.nan  # XGBoost and LightGBM route missing values by each split's default direction
X_MISSING[1::5, 3] = np.nan


def write_model(
    repo: Path, name: str, filename: str, save, params: dict, shap_dims: list[int], extra: str = ""
):
    vdir = repo / name / "1"
    vdir.mkdir(parents=True)
    save(vdir / filename)
    lines = [
        f'name: "{name}"',
        'backend: "fil"',
        "max_batch_size: 64",
        f'input [ {{ name: "input__0" data_type: TYPE_FP32 dims: [ {FEATURES} ] }} ]',
        "output [",
        '  { name: "output__0" data_type: TYPE_FP32 dims: [ 1 ] },',
        f'  {{ name: "treeshap_output" data_type: TYPE_FP32 dims: [ {", ".join(map(str, shap_dims))} ] }}',
        "]",
        *(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in params.items()),
        extra,
    ]
    (repo / name / "config.pbtxt").write_text("\n".join(lines))


def treelite_save(model):
    return lambda path: treelite.sklearn.import_model(model).serialize(str(path))


def explainer_values(model, x: np.ndarray) -> np.ndarray:
    """shap's TreeExplainer in Triton FIL's layout: (n, f + 1), or (n, classes, f + 1) when it explains classes."""
    explainer = shap.TreeExplainer(model)
    values = np.asarray(explainer.shap_values(x))
    bias = np.atleast_1d(explainer.expected_value)
    if values.ndim == 2:
        return np.concatenate([values, np.full((len(x), 1), bias[0])], axis=1)
    return np.concatenate([values, np.broadcast_to(bias, (len(x), 1, bias.size))], axis=1).transpose(0, 2, 1)


F1 = FEATURES + 1
CLASSIFIER = {"output_class": "true"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Trains the models, writes them with a `treeshap_output`, starts one server; yields (server, expectations)."""
    repo = tmp_path_factory.mktemp("fil_shap") / "models"
    repo.mkdir()
    expect: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # name -> (rows, SHAP values)

    def contribs(booster, x):
        return booster.predict(xgb.DMatrix(x), pred_contribs=True)

    xr = xgb.XGBRegressor(n_estimators=20, max_depth=4).fit(X_TRAIN, Y_REG).get_booster()
    write_model(repo, "xgb_reg", "xgboost.json", xr.save_model, {"model_type": "xgboost_json"}, [F1])
    expect["xgb_reg"] = (X_MISSING, contribs(xr, X_MISSING))
    xb = xgb.XGBClassifier(n_estimators=20, max_depth=3).fit(X_TRAIN, Y_BINARY).get_booster()
    write_model(
        repo, "xgb_binary", "xgboost.ubj", xb.save_model, {"model_type": "xgboost_ubj", **CLASSIFIER}, [F1]
    )
    expect["xgb_binary"] = (X_MISSING, contribs(xb, X_MISSING))
    xm = xgb.XGBClassifier(n_estimators=15, max_depth=3).fit(X_TRAIN, Y_MULTI).get_booster()
    write_model(repo, "xgb_multi", "xgboost.model", xm.save_model, CLASSIFIER, [3, F1])
    expect["xgb_multi"] = (X_MISSING, contribs(xm, X_MISSING))
    write_model(
        repo,
        "xgb_multi_batched",
        "xgboost.model",
        xm.save_model,
        CLASSIFIER,
        [3, F1],
        "dynamic_batching { max_queue_delay_microseconds: 50000 }",
    )
    expect["xgb_multi_batched"] = expect["xgb_multi"]

    lr = lgb.LGBMRegressor(n_estimators=15, num_leaves=9, verbose=-1).fit(X_TRAIN, Y_REG).booster_
    write_model(repo, "lgb_reg", "model.txt", lr.save_model, {"model_type": "lightgbm"}, [F1])
    expect["lgb_reg"] = (X_MISSING, lr.predict(X_MISSING, pred_contrib=True))
    lb = lgb.LGBMClassifier(n_estimators=15, num_leaves=7, verbose=-1).fit(X_TRAIN, Y_BINARY).booster_
    write_model(
        repo, "lgb_binary", "model.txt", lb.save_model, {"model_type": "lightgbm", **CLASSIFIER}, [F1]
    )
    expect["lgb_binary"] = (X_MISSING, lb.predict(X_MISSING, pred_contrib=True))
    lm = lgb.LGBMClassifier(n_estimators=15, num_leaves=7, verbose=-1).fit(X_TRAIN, Y_MULTI).booster_
    write_model(
        repo, "lgb_multi", "model.txt", lm.save_model, {"model_type": "lightgbm", **CLASSIFIER}, [3, F1]
    )
    # LightGBM puts the classes side by side: (n, classes * (features + 1))
    expect["lgb_multi"] = (X_MISSING, lm.predict(X_MISSING, pred_contrib=True).reshape(-1, 3, F1))

    # scikit-learn as Treelite checkpoints; SHAP values from TreeExplainer on the scikit-learn model itself
    tl = {"model_type": "treelite_checkpoint"}
    rr = ensemble.RandomForestRegressor(n_estimators=12, max_depth=6, random_state=0).fit(X_TRAIN, Y_REG)
    write_model(repo, "rf_reg", "checkpoint.tl", treelite_save(rr), tl, [F1])
    expect["rf_reg"] = (X_TEST, explainer_values(rr, X_TEST))
    # a random forest classifier averages class probabilities: one row of values per class, binary too
    rb = ensemble.RandomForestClassifier(n_estimators=12, max_depth=5, random_state=0).fit(X_TRAIN, Y_BINARY)
    write_model(repo, "rf_binary", "checkpoint.tl", treelite_save(rb), {**tl, **CLASSIFIER}, [2, F1])
    expect["rf_binary"] = (X_TEST, explainer_values(rb, X_TEST))
    rm = ensemble.RandomForestClassifier(n_estimators=12, max_depth=5, random_state=0).fit(X_TRAIN, Y_MULTI)
    write_model(repo, "rf_multi", "checkpoint.tl", treelite_save(rm), {**tl, **CLASSIFIER}, [3, F1])
    expect["rf_multi"] = (X_TEST, explainer_values(rm, X_TEST))
    # trees too deep for TreeSHAP's tables: walked recursively
    rd = ensemble.RandomForestRegressor(n_estimators=4, random_state=0).fit(X_TRAIN, Y_REG)
    write_model(repo, "rf_deep", "checkpoint.tl", treelite_save(rd), tl, [F1])
    expect["rf_deep"] = (X_TEST, explainer_values(rd, X_TEST))
    # gradient boosting: log-odds, one row
    gb = ensemble.GradientBoostingClassifier(n_estimators=15, max_depth=3, random_state=0).fit(
        X_TRAIN, Y_BINARY
    )
    write_model(repo, "gb_binary", "checkpoint.tl", treelite_save(gb), {**tl, **CLASSIFIER}, [F1])
    expect["gb_binary"] = (X_TEST, explainer_values(gb, X_TEST))

    proc = NaiadProcess(repo)
    proc.start()
    try:
        yield proc, expect
    finally:
        proc.stop()


def infer(
    server, name: str, x: np.ndarray, outputs=("output__0", "treeshap_output")
) -> dict[str, np.ndarray]:
    client = httpclient.InferenceServerClient(server.http)
    try:
        inp = httpclient.InferInput("input__0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer(name, [inp], outputs=[httpclient.InferRequestedOutput(o) for o in outputs])
        return {o: result.as_numpy(o) for o in outputs}
    finally:
        client.close()


MODELS = ["xgb_reg", "xgb_binary", "xgb_multi", "lgb_reg", "lgb_binary", "lgb_multi"]
MODELS += ["rf_reg", "rf_binary", "rf_multi", "rf_deep", "gb_binary"]


@pytest.mark.parametrize("name", MODELS)
def test_shap_values_equal_the_librarys(served, name):
    server, expect = served
    x, want = expect[name]
    got = infer(server, name, x)["treeshap_output"]
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["xgb_multi", "lgb_binary", "rf_multi"])
def test_shap_values_sum_to_the_raw_score(served, name):
    """Additivity: the features' values plus the bias are the model's margin for each row (and class)."""
    server, expect = served
    x, want = expect[name]
    got = infer(server, name, x)["treeshap_output"]
    np.testing.assert_allclose(got.sum(axis=-1), want.sum(axis=-1), rtol=1e-4, atol=1e-4)


def test_model_config_reports_the_shap_output(served):
    server, _ = served
    client = httpclient.InferenceServerClient(server.http)
    try:
        outputs = {o["name"]: o["dims"] for o in client.get_model_config("xgb_multi")["output"]}
        metadata = {o["name"]: o["shape"] for o in client.get_model_metadata("xgb_multi")["outputs"]}
    finally:
        client.close()
    assert outputs["treeshap_output"] == [3, F1]
    assert metadata["treeshap_output"] == [-1, 3, F1]


def test_only_the_shap_output_when_only_it_is_asked_for(served):
    server, expect = served
    x, want = expect["xgb_reg"]
    got = infer(server, "xgb_reg", x, outputs=("treeshap_output",))
    assert list(got) == ["treeshap_output"]
    np.testing.assert_allclose(got["treeshap_output"], want, rtol=1e-4, atol=1e-5)


def test_grpc_gives_the_same_values(served):
    server, expect = served
    x, want = expect["lgb_multi"]
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        inp = grpcclient.InferInput("input__0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        got = client.infer("lgb_multi", [inp]).as_numpy("treeshap_output")
    finally:
        client.close()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_dynamically_batched_requests_get_their_own_rows(served):
    server, expect = served
    x, want = expect["xgb_multi_batched"]
    rows = [(i, i + 1 + i % 3) for i in range(0, 30)]
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda r: infer(server, "xgb_multi_batched", x[r[0] : r[1]]), rows))
    for (a, b), got in zip(rows, results):
        np.testing.assert_allclose(got["treeshap_output"], want[a:b], rtol=1e-4, atol=1e-5)


def test_wrong_shap_dims_fail_to_load_with_reasons(tmp_path):
    repo = tmp_path / "models"
    repo.mkdir()
    xr = xgb.XGBRegressor(n_estimators=3).fit(X_TRAIN, Y_REG).get_booster()
    xm = xgb.XGBClassifier(n_estimators=3).fit(X_TRAIN, Y_MULTI).get_booster()
    write_model(repo, "short", "xgboost.json", xr.save_model, {"model_type": "xgboost_json"}, [FEATURES])
    write_model(
        repo, "flat_multi", "xgboost.json", xm.save_model, {"model_type": "xgboost_json", **CLASSIFIER}, [F1]
    )
    (repo / "int_shap" / "1").mkdir(parents=True)
    xr.save_model(repo / "int_shap" / "1" / "xgboost.json")
    text = (repo / "short" / "config.pbtxt").read_text().replace('"short"', '"int_shap"')
    text = text.replace(
        f'"treeshap_output" data_type: TYPE_FP32 dims: [ {FEATURES} ]',
        f'"treeshap_output" data_type: TYPE_INT32 dims: [ {F1} ]',
    )
    (repo / "int_shap" / "config.pbtxt").write_text(text)
    proc = NaiadProcess(repo, "--model-control-mode", "explicit")
    proc.start()
    client = httpclient.InferenceServerClient(proc.http)
    try:
        cases = {
            "short": rf"'treeshap_output' must have dims \[{F1}\]",
            "flat_multi": rf"'treeshap_output' must have dims \[3, {F1}\]",
            "int_shap": "'treeshap_output' must be TYPE_FP32",
        }
        for name, message in cases.items():
            with pytest.raises(InferenceServerException, match=message):
                client.load_model(name)
    finally:
        client.close()
        proc.stop()


@pytest.mark.parametrize("tables", [True, False])
def test_treeshap_tables_and_walk_give_the_explainers_values(monkeypatch, tables):
    """The two ways of Naiad's TreeSHAP, each forced on the same models, against TreeExplainer."""
    from naiad.backends import fil_treeshap

    monkeypatch.setattr(fil_treeshap, "TABLE_LIMIT", fil_treeshap.TABLE_LIMIT if tables else 0)
    rm = ensemble.RandomForestClassifier(n_estimators=5, max_depth=5, random_state=1).fit(X_TRAIN, Y_MULTI)
    gb = ensemble.GradientBoostingRegressor(n_estimators=8, max_depth=4, random_state=1).fit(X_TRAIN, Y_REG)
    for model in (rm, gb):
        explainer = fil_treeshap.TreeShap(
            treelite.sklearn.import_model(model).dump_as_json(pretty_print=False)
        )
        assert all((t.table is not None) == tables for t in explainer.trees)
        got = explainer.shap_values(X_TEST)
        want = explainer_values(model, X_TEST)
        np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-9, atol=1e-12)
