"""Builds the test model repository: committed python models plus ONNX and TorchScript models exported here."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Models that share tests/models/batch_probe.py as their model.py.
BATCH_PROBES = ("batched", "preferred", "queue_limited", "queue_timeout", "prioritized", "cached", "warm")

# Rate-limiter test models: the `slow` model's code under their own configs.
SLOW_COPIES = ("limited_a", "limited_b")

MLP_CONFIG = """
name: "mlp_onnx"
platform: "onnxruntime_onnx"
max_batch_size: 16
input [ { name: "input" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "output" data_type: TYPE_FP32 dims: [ 8 ] } ]
"""

ADD_PT_CONFIG = """
name: "add_pt"
platform: "pytorch_libtorch"
max_batch_size: 8
input [
  { name: "INPUT__0" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "INPUT__1" data_type: TYPE_FP32 dims: [ -1 ] }
]
output [
  { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "OUTPUT__1" data_type: TYPE_FP32 dims: [ -1 ] }
]
"""


def mlp(in_features: int = 16, out_features: int = 8):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(in_features, 32), torch.nn.ReLU(), torch.nn.Linear(32, out_features)
    ).eval()


def export_onnx(module, path: Path, in_features: int, dynamic_batch: bool = True) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    axes = {"input": {0: "batch"}, "output": {0: "batch"}} if dynamic_batch else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            (torch.zeros(1, in_features),),
            str(path),
            input_names=["input"],
            output_names=["output"],
            dynamic_axes=axes,
            opset_version=17,
            dynamo=False,
        )


RESHAPE_ONNX_CONFIG = """
name: "reshape_onnx"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "input" data_type: TYPE_FP32 dims: [ 12 ] reshape { shape: [ 3, 4 ] } } ]
output [ { name: "output" data_type: TYPE_FP32 dims: [ 12 ] reshape { shape: [ 3, 4 ] } } ]
"""


def build_reshape_onnx(out: Path) -> Path:
    """`reshape_onnx`: an ONNX graph of rank-3 [batch, 3, 4] I/O (output = 2 * input + row index), served with
    `dims: [12] reshape { shape: [3, 4] }` so that only a server applying `reshape` can run it."""
    import torch

    class RowScale(torch.nn.Module):
        def forward(self, x):
            return x * 2 + torch.arange(3, dtype=x.dtype).reshape(1, 3, 1)

    model_dir = out / "reshape_onnx"
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            RowScale().eval(),
            (torch.zeros(1, 3, 4),),
            str(model_dir / "1" / "model.onnx"),
            input_names=["input"],
            output_names=["output"],
            dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
            opset_version=17,
            dynamo=False,
        )
    (model_dir / "config.pbtxt").write_text(RESHAPE_ONNX_CONFIG)
    return model_dir


class AddMul:
    """Builds the TorchScript module lazily so importing this file does not import torch."""

    @staticmethod
    def script():
        import torch

        class M(torch.nn.Module):
            def forward(self, a, b):
                return a + b, a * b

        return torch.jit.script(M())


def build(out: Path) -> Path:
    import torch

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(HERE / "models", out, ignore=shutil.ignore_patterns("__pycache__", "batch_probe.py"))
    for name in BATCH_PROBES:
        (out / name / "1").mkdir(parents=True, exist_ok=True)
        shutil.copy(HERE / "models" / "batch_probe.py", out / name / "1" / "model.py")
    for name in SLOW_COPIES:
        (out / name / "1").mkdir(parents=True, exist_ok=True)
        shutil.copy(HERE / "models" / "slow" / "1" / "model.py", out / name / "1" / "model.py")
    model = mlp()
    export_onnx(model, out / "mlp_onnx" / "1" / "model.onnx", 16)
    (out / "mlp_onnx" / "config.pbtxt").write_text(MLP_CONFIG)
    export_onnx(model, out / "mlp_onnx_auto" / "1" / "model.onnx", 16)
    export_onnx(model, out / "mlp_onnx_fixed" / "1" / "model.onnx", 16, dynamic_batch=False)
    (out / "add_pt" / "1").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(AddMul.script(), str(out / "add_pt" / "1" / "model.pt"))
    (out / "add_pt" / "config.pbtxt").write_text(ADD_PT_CONFIG)
    build_reshape_onnx(out)
    return out
