"""Build examples/model_repository from examples/src: configs and python models are copied, the tutorial's
SimpleModel is traced to TorchScript and exported to ONNX (weights seeded, so outputs are reproducible), and a
tiny random-weight llama GGUF is written for the llama.cpp engine (the OpenAI API's example model)."""

from __future__ import annotations

import argparse
import shutil
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def build(out: Path) -> None:
    import torch

    sys.path.insert(0, str(HERE / "src"))
    from simple_model import SimpleModel

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(HERE / "src", out, ignore=shutil.ignore_patterns("simple_model.py", "__pycache__"))
    torch.manual_seed(0)
    model = SimpleModel().eval()
    ipt = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(model, ipt, strict=True)
        (out / "fc_model_pt" / "1").mkdir(parents=True, exist_ok=True)
        torch.jit.save(traced, str(out / "fc_model_pt" / "1" / "model.pt"))
        for name in ("simple_onnx", "simple_onnx_batched"):
            (out / name / "1").mkdir(parents=True, exist_ok=True)
            torch.onnx.export(
                model,
                (ipt,),
                str(out / name / "1" / "model.onnx"),
                input_names=["input_ids"],
                output_names=["output1", "output2"],
                dynamic_axes={
                    "input_ids": {0: "batch", 1: "seq"},
                    "output1": {0: "batch", 1: "seq"},
                    "output2": {0: "batch", 1: "seq"},
                },
                opset_version=17,
                dynamo=False,
            )
    # the same tiny GGUF the LLM tests serve (a byte-level BPE tokenizer and a ChatML template in its metadata)
    sys.path.insert(0, str(ROOT / "tests"))
    from llm_models import write_tiny_gguf

    write_tiny_gguf(out / "tiny_llama" / "1" / "model.gguf")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=str(HERE / "model_repository"))
    args = p.parse_args()
    build(Path(args.out))
    print(f"model repository ready at {args.out}")


if __name__ == "__main__":
    main()
