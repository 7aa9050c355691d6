"""The fil backend: XGBoost, LightGBM and scikit-learn (via Treelite) models trained here, served, and compared
with the library's own predict / predict_proba."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightgbm as lgb  # naiad[fil]: a missing library fails these tests rather than skipping them
import numpy as np
import pytest
import treelite
import treelite.sklearn
import tritonclient.http as httpclient
import xgboost as xgb
from helpers import NaiadProcess
from sklearn import ensemble
from tritonclient.utils import InferenceServerException

# XGBoost >= 2.1 writes UBJSON to `xgboost.model` (Triton FIL's name for model_type "xgboost") and says so.
pytestmark = pytest.mark.filterwarnings("ignore:.*Saving model in the UBJSON format as default")

FEATURES = 6
rng = np.random.default_rng(7)
X_TRAIN = rng.normal(size=(400, FEATURES)).astype(np.float32)
Y_BINARY = (X_TRAIN[:, 0] + 0.5 * X_TRAIN[:, 1] > 0).astype(int)
Y_MULTI = (X_TRAIN[:, 0] > 0.4).astype(int) + (X_TRAIN[:, 2] > 0).astype(int)  # 3 classes
Y_REG = X_TRAIN[:, 0] * 2.0 - X_TRAIN[:, 3]
X_TEST = rng.normal(size=(37, FEATURES)).astype(np.float32)


def write_model(repo: Path, name: str, filename: str, save, params: dict, width: int | None, extra: str = ""):
    vdir = repo / name / "1"
    vdir.mkdir(parents=True)
    save(vdir / filename)
    lines = [f'name: "{name}"', 'backend: "fil"', "max_batch_size: 64"]
    if width is not None:
        lines.append(f'input [ {{ name: "input__0" data_type: TYPE_FP32 dims: [ {FEATURES} ] }} ]')
        lines.append(f'output [ {{ name: "output__0" data_type: TYPE_FP32 dims: [ {width} ] }} ]')
    for k, v in params.items():
        lines.append(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}')
    lines.append(extra)
    (repo / name / "config.pbtxt").write_text("\n".join(lines))


def treelite_save(model):
    return lambda path: treelite.sklearn.import_model(model).serialize(str(path))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Trains every model, writes Triton FIL's layout, starts one server; yields (server, expectations)."""
    repo = tmp_path_factory.mktemp("fil") / "models"
    repo.mkdir()
    expect: dict[str, np.ndarray] = {}
    proba, klass = {"output_class": "true", "predict_proba": "true"}, {"output_class": "true"}

    xb = xgb.XGBClassifier(n_estimators=20, max_depth=3).fit(X_TRAIN, Y_BINARY)
    save = xb.get_booster().save_model
    write_model(repo, "xgb_binary_proba", "xgboost.json", save, {"model_type": "xgboost_json", **proba}, 1)
    expect["xgb_binary_proba"] = xb.predict_proba(X_TEST)[:, 1:]
    write_model(repo, "xgb_binary_proba2", "xgboost.json", save, {"model_type": "xgboost_json", **proba}, 2)
    expect["xgb_binary_proba2"] = xb.predict_proba(X_TEST)
    write_model(repo, "xgb_binary_class", "xgboost.ubj", save, {"model_type": "xgboost_ubj", **klass}, 1)
    expect["xgb_binary_class"] = xb.predict(X_TEST)[:, None]
    strict = {"model_type": "xgboost_ubj", "threshold": "0.8", **klass}
    write_model(repo, "xgb_binary_threshold", "xgboost.ubj", save, strict, 1)
    expect["xgb_binary_threshold"] = (xb.predict_proba(X_TEST)[:, 1] > 0.8)[:, None]

    xm = xgb.XGBClassifier(n_estimators=15, max_depth=3).fit(X_TRAIN, Y_MULTI)
    save = xm.get_booster().save_model
    write_model(repo, "xgb_multi_proba", "xgboost.model", save, proba, 3)  # model_type defaults to xgboost
    expect["xgb_multi_proba"] = xm.predict_proba(X_TEST)
    write_model(repo, "xgb_multi_class", "xgboost.model", save, {"model_type": "xgboost", **klass}, 1)
    expect["xgb_multi_class"] = xm.predict(X_TEST)[:, None]

    xr = xgb.XGBRegressor(n_estimators=20, max_depth=3).fit(X_TRAIN, Y_REG)
    write_model(
        repo, "xgb_reg", "xgboost.json", xr.get_booster().save_model, {"model_type": "xgboost_json"}, 1
    )
    expect["xgb_reg"] = xr.predict(X_TEST)[:, None]

    lm = lgb.LGBMClassifier(n_estimators=15, num_leaves=7, verbose=-1).fit(X_TRAIN, Y_MULTI)
    save = lm.booster_.save_model
    write_model(repo, "lgb_multi_proba", "model.txt", save, {"model_type": "lightgbm", **proba}, 3)
    expect["lgb_multi_proba"] = lm.predict_proba(X_TEST)
    write_model(repo, "lgb_multi_class", "model.txt", save, {"model_type": "lightgbm", **klass}, 1)
    expect["lgb_multi_class"] = lm.predict(X_TEST)[:, None]
    lb = lgb.LGBMClassifier(n_estimators=15, num_leaves=7, verbose=-1).fit(X_TRAIN, Y_BINARY)
    write_model(
        repo, "lgb_binary_class", "model.txt", lb.booster_.save_model, {"model_type": "lightgbm", **klass}, 1
    )
    expect["lgb_binary_class"] = lb.predict(X_TEST)[:, None]
    lr = lgb.LGBMRegressor(n_estimators=15, num_leaves=7, verbose=-1).fit(X_TRAIN, Y_REG)
    write_model(repo, "lgb_reg", "model.txt", lr.booster_.save_model, {"model_type": "lightgbm"}, 1)
    expect["lgb_reg"] = lr.predict(X_TEST)[:, None]

    # scikit-learn reaches FIL as a Treelite checkpoint, as Triton FIL documents.
    rf = ensemble.RandomForestClassifier(n_estimators=10, max_depth=5, random_state=0).fit(X_TRAIN, Y_MULTI)
    tl = {"model_type": "treelite_checkpoint"}
    write_model(repo, "rf_multi_proba", "checkpoint.tl", treelite_save(rf), {**tl, **proba}, 3)
    expect["rf_multi_proba"] = rf.predict_proba(X_TEST)
    write_model(repo, "rf_multi_class", "checkpoint.tl", treelite_save(rf), {**tl, **klass}, 1)
    expect["rf_multi_class"] = rf.predict(X_TEST)[:, None]
    rb = ensemble.RandomForestClassifier(n_estimators=10, max_depth=5, random_state=0).fit(X_TRAIN, Y_BINARY)
    write_model(repo, "rf_binary_proba2", "checkpoint.tl", treelite_save(rb), {**tl, **proba}, 2)
    expect["rf_binary_proba2"] = rb.predict_proba(X_TEST)
    rr = ensemble.RandomForestRegressor(n_estimators=10, max_depth=5, random_state=0).fit(X_TRAIN, Y_REG)
    write_model(repo, "rf_reg", "checkpoint.tl", treelite_save(rr), tl, 1)
    expect["rf_reg"] = rr.predict(X_TEST)[:, None]

    # No input/output in the config: completed from the model file.
    write_model(
        repo,
        "xgb_auto",
        "xgboost.json",
        xm.get_booster().save_model,
        {"model_type": "xgboost_json", **proba},
        None,
    )
    expect["xgb_auto"] = xm.predict_proba(X_TEST)
    # Dynamic batching with a queue delay, so that concurrent requests share executions.
    write_model(
        repo,
        "xgb_batched",
        "xgboost.json",
        xr.get_booster().save_model,
        {"model_type": "xgboost_json"},
        1,
        "dynamic_batching { max_queue_delay_microseconds: 50000 }",
    )
    proc = NaiadProcess(repo)
    proc.start()
    try:
        yield proc, expect
    finally:
        proc.stop()


def infer(server, name: str, x: np.ndarray) -> np.ndarray:
    client = httpclient.InferenceServerClient(server.http)
    try:
        inp = httpclient.InferInput("input__0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        return client.infer(name, [inp]).as_numpy("output__0")
    finally:
        client.close()


MODELS = [
    "xgb_binary_proba",
    "xgb_binary_proba2",
    "xgb_binary_class",
    "xgb_binary_threshold",
    "xgb_multi_proba",
    "xgb_multi_class",
    "xgb_reg",
    "lgb_multi_proba",
    "lgb_multi_class",
    "lgb_binary_class",
    "lgb_reg",
    "rf_multi_proba",
    "rf_multi_class",
    "rf_binary_proba2",
    "rf_reg",
    "xgb_auto",
]


@pytest.mark.parametrize("name", MODELS)
def test_matches_library_predictions(served, name):
    server, expect = served
    got = infer(server, name, X_TEST)
    want = np.asarray(expect[name], dtype=np.float32)
    assert got.dtype == np.float32
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_auto_completed_config(served):
    server, _ = served
    client = httpclient.InferenceServerClient(server.http)
    try:
        config = client.get_model_config("xgb_auto")
    finally:
        client.close()
    assert config["input"][0]["name"] == "input__0" and config["input"][0]["dims"] == [FEATURES]
    assert config["output"][0]["name"] == "output__0" and config["output"][0]["dims"] == [3]


def test_dynamic_batching_matches_single_requests(served):
    """Concurrent requests are batched together, and every row still gets its own prediction back."""
    server, expect = served
    rows = [X_TEST[i : i + 1 + i % 3] for i in range(0, 32)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda x: infer(server, "xgb_batched", x), rows))
    for x, got in zip(rows, results):
        idx = [int(np.where((X_TEST == r).all(axis=1))[0][0]) for r in x]
        np.testing.assert_allclose(got, expect["xgb_reg"][idx], rtol=1e-5, atol=1e-5)
    client = httpclient.InferenceServerClient(server.http)
    try:
        stats = client.get_inference_statistics("xgb_batched")["model_stats"][0]
    finally:
        client.close()
    assert stats["inference_count"] == sum(len(x) for x in rows)
    assert stats["execution_count"] < len(rows)  # some executions served several requests


def test_wrong_feature_count_is_a_clear_error(served):
    server, _ = served
    with pytest.raises(InferenceServerException, match=r"input__0"):
        infer(server, "xgb_reg", np.zeros((2, FEATURES + 1), np.float32))


def test_bad_fil_configs_fail_to_load_with_reasons(tmp_path):
    repo = tmp_path / "models"
    repo.mkdir()
    xr = xgb.XGBRegressor(n_estimators=3).fit(X_TRAIN, Y_REG)
    save = xr.get_booster().save_model
    write_model(repo, "bad_type", "xgboost.json", save, {"model_type": "pickle"}, 1)
    write_model(repo, "bad_width", "xgboost.json", save, {"model_type": "xgboost_json"}, 4)
    write_model(repo, "bad_features", "xgboost.json", save, {"model_type": "xgboost_json"}, 1)
    text = (
        (repo / "bad_features" / "config.pbtxt").read_text().replace(f"dims: [ {FEATURES} ]", "dims: [ 9 ]")
    )
    (repo / "bad_features" / "config.pbtxt").write_text(text)
    write_model(repo, "missing_file", "xgboost.json", save, {"model_type": "lightgbm"}, 1)
    write_model(
        repo, "bad_storage", "xgboost.json", save, {"model_type": "xgboost_json", "storage_type": "FAST"}, 1
    )
    proc = NaiadProcess(repo, "--model-control-mode", "explicit")
    proc.start()
    client = httpclient.InferenceServerClient(proc.http)
    try:
        cases = {
            "bad_type": "unknown FIL model_type 'pickle'",
            "bad_width": "must have 1 column",
            "bad_features": "has 9 features in the config, the model was trained on 6",
            "missing_file": "model.txt not found",
            "bad_storage": "storage_type 'FAST' is not one of",
        }
        for name, message in cases.items():
            with pytest.raises(InferenceServerException, match=message):
                client.load_model(name)
    finally:
        client.close()
        proc.stop()


@pytest.mark.gpu
def test_xgboost_on_gpu_matches_cpu(tmp_path):
    from naiad import gpu

    if gpu.device_count() == 0:
        pytest.skip("no CUDA device")
    repo = tmp_path / "models"
    repo.mkdir()
    xm = xgb.XGBClassifier(n_estimators=15, max_depth=3).fit(X_TRAIN, Y_MULTI)
    params = {"model_type": "xgboost_json", "output_class": "true", "predict_proba": "true"}
    write_model(
        repo,
        "g",
        "xgboost.json",
        xm.get_booster().save_model,
        params,
        3,
        "instance_group [ { kind: KIND_GPU } ]",
    )
    proc = NaiadProcess(repo)
    proc.start()
    try:
        np.testing.assert_allclose(infer(proc, "g", X_TEST), xm.predict_proba(X_TEST), rtol=1e-5, atol=1e-5)
    finally:
        proc.stop()
