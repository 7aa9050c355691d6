"""FIL backend: tree models (XGBoost, LightGBM, Treelite checkpoints) with Triton FIL's layout, parameters and SHAP
output (`treeshap_output`)."""

from __future__ import annotations

import abc
import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..config import ModelConfig
from ..errors import InvalidArgument, Unavailable
from .api import Backend, InstanceState, ModelState
from .fil_treeshap import TreeShap

log = logging.getLogger("naiad.fil")

# model_type -> the file Triton FIL reads from each version folder
MODEL_FILES = {
    "xgboost": "xgboost.model",
    "xgboost_json": "xgboost.json",
    "xgboost_ubj": "xgboost.ubj",
    "lightgbm": "model.txt",
    "treelite_checkpoint": "checkpoint.tl",
}
DEFAULT_MODEL_TYPE = "xgboost"
STORAGE_TYPES = ("AUTO", "DENSE", "SPARSE", "SPARSE8")
ALGOS = ("ALGO_AUTO", "NAIVE", "TREE_REORG", "BATCH_TREE_REORG")
#: Triton FIL's optional second output: SHAP values, [n_features + 1] or [n_classes, n_features + 1], bias last.
SHAP_OUTPUT = "treeshap_output"


def _library(name: str, extra_hint: str = "naiad[fil]"):
    try:
        return __import__(name)
    except ImportError:
        raise Unavailable(
            f"the fil backend needs the '{name}' package for this model: pip install '{extra_hint}'"
        ) from None


def _bool(params: dict[str, str], key: str, default: bool, model: str) -> bool:
    value = params.get(key, "").strip().lower()
    if not value:
        return default
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise InvalidArgument(f"model '{model}': parameter '{key}' must be true or false, got '{params[key]}'")


@dataclass(frozen=True)
class FilParameters:
    """The FIL parameters of one model, read and checked once (Triton FIL's string-valued `parameters`)."""

    model_type: str
    output_class: bool
    predict_proba: bool
    threshold: float
    storage_type: str
    algo: str

    @classmethod
    def parse(cls, config: ModelConfig) -> FilParameters:
        name = config.name
        params = {k: v.string_value for k, v in config.parameters.items()}
        model_type = params.get("model_type", "").strip() or DEFAULT_MODEL_TYPE
        if model_type not in MODEL_FILES:
            raise InvalidArgument(
                f"model '{name}': unknown FIL model_type '{model_type}' (expected one of {', '.join(MODEL_FILES)}; "
                "scikit-learn models are served as Treelite checkpoints: treelite.sklearn.import_model)"
            )
        # `is_classifier` is the newer FIL spelling of `output_class`.
        output_class = _bool(params, "output_class", _bool(params, "is_classifier", False, name), name)
        predict_proba = _bool(params, "predict_proba", False, name)
        try:
            threshold = float(params.get("threshold", "") or 0.5)
        except ValueError:
            raise InvalidArgument(
                f"model '{name}': parameter 'threshold' must be a number, got '{params['threshold']}'"
            ) from None
        storage_type = (params.get("storage_type", "") or "AUTO").upper()
        if storage_type not in STORAGE_TYPES:
            raise InvalidArgument(
                f"model '{name}': storage_type '{storage_type}' is not one of {', '.join(STORAGE_TYPES)}"
            )
        algo = (params.get("algo", "") or "ALGO_AUTO").upper()
        if algo not in ALGOS:
            raise InvalidArgument(f"model '{name}': algo '{algo}' is not one of {', '.join(ALGOS)}")
        return cls(model_type, output_class, predict_proba, threshold, storage_type, algo)


class Forest(abc.ABC):
    """A loaded tree ensemble: `predict` gives probabilities (classifiers) or values (regressors), shaped
    (n,) for one score per row or (n, k) for k classes."""

    num_features: int
    num_classes: int  # 1 for regressors and binary classifiers that give one score

    @abc.abstractmethod
    def predict(self, x: np.ndarray) -> np.ndarray:
        """Scores for the rows of `x` (float32, shape (n, num_features))."""

    @abc.abstractmethod
    def contributions(self, x: np.ndarray) -> np.ndarray:
        """SHAP values of the rows of `x` in the raw-score (margin) space, shaped (n, num_classes, num_features + 1)
        with the bias last: the library's own TreeSHAP where it has one."""


class XGBoostForest(Forest):
    def __init__(self, path: Path, nthread: int, device: str):
        xgb = _library("xgboost")
        self.booster = xgb.Booster()
        try:
            # From bytes, XGBoost tells JSON from UBJSON by content rather than by the file's extension.
            self.booster.load_model(bytearray(path.read_bytes()))
        except Exception as exc:
            raise InvalidArgument(f"failed to load XGBoost model {path}: {exc}") from None
        learner = json.loads(self.booster.save_config())["learner"]
        if learner["objective"]["name"] == "multi:softmax":
            # FIL computes classes from probabilities itself (output_class/predict_proba).
            self.booster.set_param({"objective": "multi:softprob"})
        self.booster.set_param({"nthread": nthread, "device": device})
        self.num_features = self.booster.num_features()
        self.num_classes = max(1, int(learner["learner_model_param"].get("num_class", "0")))
        self.xgb, self.nthread = xgb, nthread

    def predict(self, x):
        with warnings.catch_warnings():
            # a CUDA booster fed host memory warns once per call that it copies the input
            warnings.simplefilter("ignore", UserWarning)
            return self.booster.inplace_predict(x, validate_features=False)

    def contributions(self, x):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dm = self.xgb.DMatrix(x, nthread=self.nthread)
            out = self.booster.predict(dm, pred_contribs=True, validate_features=False)
        return out.reshape(x.shape[0], self.num_classes, self.num_features + 1)


class LightGBMForest(Forest):
    def __init__(self, path: Path, nthread: int):
        lgb = _library("lightgbm")
        try:
            self.booster = lgb.Booster(model_file=str(path))
        except Exception as exc:
            raise InvalidArgument(f"failed to load LightGBM model {path}: {exc}") from None
        self.nthread = nthread
        self.num_features = self.booster.num_feature()
        self.num_classes = self.booster.num_model_per_iteration()

    def predict(self, x):
        return self.booster.predict(x, num_threads=self.nthread)

    def contributions(self, x):
        # multi-class: one row of (features + 1) per class, side by side
        out = self.booster.predict(x, pred_contrib=True, num_threads=self.nthread)
        return np.asarray(out).reshape(x.shape[0], self.num_classes, self.num_features + 1)


class TreeliteForest(Forest):
    def __init__(self, path: Path, nthread: int):
        _library("treelite")
        import treelite
        import treelite.gtil

        try:
            self.model = treelite.Model.deserialize(str(path))
        except Exception as exc:
            raise InvalidArgument(f"failed to load Treelite checkpoint {path}: {exc}") from None
        header = self.model.get_header_accessor()
        targets = int(np.asarray(header.get_field("num_target")).ravel()[0])
        if targets != 1:
            raise InvalidArgument(f"Treelite checkpoint {path} has {targets} targets; FIL serves one")
        self.gtil = treelite.gtil
        self.nthread = nthread
        self.num_features = self.model.num_feature
        self.num_classes = int(np.max(header.get_field("num_class")))
        self._treeshap: TreeShap | None = None

    def predict(self, x):
        out = self.gtil.predict(self.model, x, nthread=self.nthread)  # (n, targets, classes)
        out = out.reshape(out.shape[0], -1)
        return out[:, 0] if out.shape[1] == 1 else out

    def explainer(self) -> TreeShap:
        """The trees as TreeSHAP reads them (built from the model's JSON dump on first use)."""
        if self._treeshap is None:
            self._treeshap = TreeShap(self.model.dump_as_json(pretty_print=False))
        return self._treeshap

    def contributions(self, x):
        return self.explainer().shap_values(x)


def load_forest(model_type: str, path: Path, nthread: int, device: str = "cpu") -> Forest:
    if model_type.startswith("xgboost"):
        return XGBoostForest(path, nthread, device)
    if model_type == "lightgbm":
        return LightGBMForest(path, nthread)
    return TreeliteForest(path, nthread)


def shap_dims(forest: Forest) -> list[int]:
    """treeshap_output's dims (no batch): Triton FIL's [n_features + 1], or [n_classes, n_features + 1] when the
    model scores more than one class."""
    if forest.num_classes > 1:
        return [forest.num_classes, forest.num_features + 1]
    return [forest.num_features + 1]


def output_width(forest: Forest, params: FilParameters) -> int:
    """Columns of output__0: one class ID or score, or a probability per class (binary: the positive one)."""
    if params.output_class and params.predict_proba:
        return forest.num_classes if forest.num_classes > 2 else 1
    return 1


def postprocess(raw: np.ndarray, params: FilParameters, width: int) -> np.ndarray:
    """Triton FIL's outputs from a forest's scores: class IDs, probabilities or regression values (FP32)."""
    raw = np.asarray(raw, dtype=np.float32)
    if raw.ndim == 1:
        raw = raw[:, None]
    if not params.output_class:
        return raw
    binary = raw.shape[1] <= 2
    if params.predict_proba:
        if raw.shape[1] == width:
            return raw
        if binary and width == 2:  # one score: P(class 1)
            return np.concatenate([1.0 - raw, raw], axis=1)
        if binary and width == 1:  # two columns: keep P(class 1)
            return raw[:, 1:]
        raise InvalidArgument(f"the model gives {raw.shape[1]} class scores; output__0 has {width} columns")
    if binary:
        positive = raw[:, -1]
        return (positive > params.threshold).astype(np.float32)[:, None]
    return np.argmax(raw, axis=1).astype(np.float32)[:, None]


@dataclass
class _FilModel:
    params: FilParameters
    input_name: str
    output_name: str
    width: int  # output__0 columns the config declares
    shap_dims: list[int] | None = (
        None  # treeshap_output's dims (no batch dimension) when the config declares it
    )


class FilBackend(Backend):
    """Tree models run by their own library on the instance's thread; batches come from the dynamic batcher."""

    name = "fil"

    def model_filename(self, config: ModelConfig) -> str:
        return config.default_model_filename or MODEL_FILES[FilParameters.parse(config).model_type]

    def auto_complete_config(self, config: ModelConfig, model_file: Path | None) -> None:
        """input__0 [features] and output__0 [1 or classes] (FP32) from the model when the config has none."""
        if (config.input and config.output) or model_file is None:
            return
        params = FilParameters.parse(config)
        forest = load_forest(params.model_type, model_file, 1)
        batch = [] if config.max_batch_size > 0 else [-1]
        if not config.input:
            t = config.input.add()
            t.name, t.data_type = "input__0", mc.TYPE_FP32
            t.dims.extend(batch + [forest.num_features])
        if not config.output:
            t = config.output.add()
            t.name, t.data_type = "output__0", mc.TYPE_FP32
            t.dims.extend(batch + [output_width(forest, params)])

    def model_initialize(self, model: ModelState) -> None:
        config = model.config
        params = FilParameters.parse(config)
        shap = [o for o in config.output if o.name == SHAP_OUTPUT]
        outputs = [o for o in config.output if o.name != SHAP_OUTPUT]
        if len(config.input) != 1 or len(outputs) != 1:
            raise InvalidArgument(
                f"model '{model.name}': the fil backend takes one input (input__0) and gives one output "
                f"(output__0), and optionally '{SHAP_OUTPUT}'; the config declares {len(config.input)} input(s) "
                f"and {len(config.output)} output(s)"
            )
        for kind, t in (("input", config.input[0]), ("output", outputs[0]), *(("output", o) for o in shap)):
            if t.data_type != mc.TYPE_FP32:
                raise InvalidArgument(
                    f"model '{model.name}': FIL {kind} '{t.name}' must be TYPE_FP32, got "
                    f"{mc.DataType.Name(t.data_type)}"
                )
        dims = list(outputs[0].dims)
        width = dims[-1] if dims and dims[-1] > 0 else 1
        shap_dims = None
        if shap:
            shap_dims = list(shap[0].dims)[0 if config.max_batch_size > 0 else 1 :]
        model.state = _FilModel(params, config.input[0].name, outputs[0].name, width, shap_dims)

    def instance_initialize(self, instance: InstanceState) -> None:
        state: _FilModel = instance.model.state
        params = state.params
        nthread = max(1, (os.cpu_count() or 1) // instance.instance_count)
        device = "cpu"
        if instance.kind == "GPU":
            if params.model_type.startswith("xgboost"):
                device = f"cuda:{instance.device_id}"
            else:
                log.warning(
                    "model '%s': %s models predict on the CPU (only XGBoost predicts on a GPU here)",
                    instance.model.name,
                    params.model_type,
                )
        forest = load_forest(params.model_type, instance.model.model_file, nthread, device)
        features = instance.model.config.input[0].dims
        if features and features[-1] > 0 and features[-1] != forest.num_features:
            raise InvalidArgument(
                f"model '{instance.model.name}': input '{state.input_name}' has {features[-1]} features in the "
                f"config, the model was trained on {forest.num_features}"
            )
        expected = output_width(forest, params)
        if state.width != expected and not (
            params.predict_proba and forest.num_classes <= 2 and state.width == 2
        ):
            raise InvalidArgument(
                f"model '{instance.model.name}': output '{state.output_name}' must have {expected} column(s) "
                f"for this model (output_class={str(params.output_class).lower()}, "
                f"predict_proba={str(params.predict_proba).lower()}), the config says {state.width}"
            )
        if state.shap_dims is not None:
            want = shap_dims(forest)
            got = state.shap_dims
            if len(got) != len(want) or any(g not in (-1, w) for g, w in zip(got, want)):
                raise InvalidArgument(
                    f"model '{instance.model.name}': output '{SHAP_OUTPUT}' must have dims {want} for this model "
                    f"({forest.num_features} features + the bias"
                    + (f", per class of {forest.num_classes}" if forest.num_classes > 1 else "")
                    + f"), the config says {got}"
                )
            if isinstance(forest, TreeliteForest):
                forest.explainer()  # read the trees now: a model TreeSHAP cannot explain fails to load
        instance.state = forest

    def instance_execute(self, instance: InstanceState, requests):
        state: _FilModel = instance.model.state
        batch = instance.gather(requests, [state.input_name])
        x = batch.inputs[state.input_name]
        x = np.ascontiguousarray(x.reshape(x.shape[0], -1) if x.ndim != 2 else x, dtype=np.float32)
        forest: Forest = instance.state
        outputs = {state.output_name: postprocess(forest.predict(x), state.params, state.width)}
        if state.shap_dims is not None and SHAP_OUTPUT in batch.outputs:
            phi = np.asarray(forest.contributions(x), dtype=np.float32)
            outputs[SHAP_OUTPUT] = phi[:, 0] if forest.num_classes == 1 else phi
        return instance.scatter(requests, batch, outputs)

    def instance_finalize(self, instance: InstanceState) -> None:
        instance.state = None


# Registered under the entry-point group naiad.backends (pyproject.toml).
backend = FilBackend()
