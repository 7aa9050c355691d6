"""Model configuration: parse config.pbtxt into Triton's ModelConfig, normalise it once, render it as JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import FieldDescriptor
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc.model_config_pb2 import ModelConfig

from .errors import InvalidArgument

# platform -> backend, and each backend's default model file name (as Triton).
PLATFORM_BACKEND = {
    "onnxruntime_onnx": "onnxruntime",
    "pytorch_libtorch": "pytorch",
    "tensorrt_plan": "tensorrt",
}
BACKEND_PLATFORM = {v: k for k, v in PLATFORM_BACKEND.items()}
DEFAULT_FILENAME = {
    "onnxruntime": "model.onnx",
    "pytorch": "model.pt",
    "tensorrt": "model.plan",
    "python": "model.py",
}
# Which file in a version folder identifies a backend when the config names none.
_DETECT = [
    ("model.onnx", "onnxruntime"),
    ("model.pt", "pytorch"),
    ("model.plan", "tensorrt"),
    ("model.py", "python"),
]

# Accept the KServe spelling (FP32) as well as the config enum (TYPE_FP32).
_DATA_TYPE_RE = re.compile(r"(\bdata_type\s*:\s*)(?!TYPE_)([A-Z][A-Z0-9]*)\b")


def _fix_data_type(match: re.Match) -> str:
    name = match.group(2)
    return f"{match.group(1)}TYPE_{'STRING' if name == 'BYTES' else name}"


def parse_text(text: str, source: str = "config.pbtxt") -> ModelConfig:
    """Parse config.pbtxt text; errors name the file, the line and what was wrong."""
    config = ModelConfig()
    try:
        text_format.Parse(_DATA_TYPE_RE.sub(_fix_data_type, text), config)
    except text_format.ParseError as exc:
        raise InvalidArgument(f"failed to parse {source}: {exc}") from None
    return config


def parse_json(data: str | dict, source: str = "config override") -> ModelConfig:
    """Parse a ModelConfig given as JSON (the repository load API's `config` parameter)."""
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except ValueError as exc:
            raise InvalidArgument(f"failed to parse {source} as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"{source} must be a JSON object")
    _fix_json_data_types(data)
    config = ModelConfig()
    try:
        json_format.ParseDict(data, config, ignore_unknown_fields=False)
    except json_format.ParseError as exc:
        raise InvalidArgument(f"failed to parse {source}: {exc}") from None
    return config


def _fix_json_data_types(node) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "data_type" and isinstance(v, str) and not v.startswith("TYPE_"):
                node[k] = "TYPE_STRING" if v == "BYTES" else f"TYPE_{v}"
            else:
                _fix_json_data_types(v)
    elif isinstance(node, list):
        for v in node:
            _fix_json_data_types(v)


def load_file(model_dir: Path) -> ModelConfig | None:
    path = model_dir / "config.pbtxt"
    if not path.is_file():
        return None
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"failed to read {path}: {exc}") from None
    return parse_text(text, str(path))


def detect_backend(config: ModelConfig, model_dir: Path, versions: list[int]) -> None:
    """Fill `backend`/`platform` as Triton does: from each other, or from the model file found."""
    if config.platform == "ensemble":
        return
    if not config.backend and config.platform:
        backend = PLATFORM_BACKEND.get(config.platform)
        if backend is None:
            raise InvalidArgument(
                f"model '{config.name}': unsupported platform '{config.platform}' "
                f"(supported: {', '.join(sorted(PLATFORM_BACKEND))}, ensemble)"
            )
        config.backend = backend
    if not config.backend:
        for v in sorted(versions, reverse=True):
            vdir = model_dir / str(v)
            names = [config.default_model_filename] if config.default_model_filename else []
            for fname, backend in _DETECT:
                if (vdir / fname).exists() or (fname in names and (vdir / fname).exists()):
                    config.backend = backend
                    break
            if config.backend:
                break
    if not config.backend:
        raise InvalidArgument(
            f"model '{config.name}': no backend or platform in config.pbtxt and no model file "
            f"({', '.join(f for f, _ in _DETECT)}) in its version folders"
        )
    if not config.platform and config.backend in BACKEND_PLATFORM:
        config.platform = BACKEND_PLATFORM[config.backend]


def normalize(config: ModelConfig, gpu_count: int = 0) -> None:
    """Apply Triton's defaults once, and validate what every later stage relies on."""
    name = config.name
    if config.max_batch_size < 0:
        raise InvalidArgument(f"model '{name}': max_batch_size must be >= 0, got {config.max_batch_size}")
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    elif config.version_policy.HasField("latest") and config.version_policy.latest.num_versions == 0:
        config.version_policy.latest.num_versions = 1
    if not config.default_model_filename and config.backend in DEFAULT_FILENAME:
        config.default_model_filename = DEFAULT_FILENAME[config.backend]

    is_ensemble = config.platform == "ensemble"
    if not is_ensemble:
        if not config.instance_group:
            config.instance_group.add()
        for i, group in enumerate(config.instance_group):
            if not group.name:
                group.name = name if len(config.instance_group) == 1 else f"{name}_{i}"
            if group.count == 0:
                group.count = 1
            if group.count < 1:
                raise InvalidArgument(f"model '{name}': instance group '{group.name}' count must be >= 1")
            if group.kind == mc.ModelInstanceGroup.KIND_AUTO:
                group.kind = (
                    mc.ModelInstanceGroup.KIND_GPU
                    if gpu_count and group.gpus
                    else (
                        mc.ModelInstanceGroup.KIND_GPU
                        if gpu_count and config.backend != "python"
                        else mc.ModelInstanceGroup.KIND_CPU
                    )
                )
            if group.kind == mc.ModelInstanceGroup.KIND_GPU:
                if not gpu_count:
                    raise InvalidArgument(
                        f"model '{name}': instance group '{group.name}' is KIND_GPU but no GPU is available"
                    )
                if not group.gpus:
                    group.gpus.extend(range(gpu_count))
                for g in group.gpus:
                    if g >= gpu_count:
                        raise InvalidArgument(
                            f"model '{name}': instance group '{group.name}' names GPU {g}, "
                            f"but only {gpu_count} GPU(s) are available"
                        )
    if config.HasField("dynamic_batching"):
        db = config.dynamic_batching
        if config.max_batch_size == 0:
            raise InvalidArgument(
                f"model '{name}': dynamic batching is enabled but max_batch_size is 0; "
                "set max_batch_size > 0 or remove dynamic_batching"
            )
        if not db.preferred_batch_size:
            db.preferred_batch_size.append(config.max_batch_size)  # Triton's default
        for size in db.preferred_batch_size:
            if size < 1 or size > config.max_batch_size:
                raise InvalidArgument(
                    f"model '{name}': dynamic batching preferred batch size {size} must be "
                    f"between 1 and max_batch_size {config.max_batch_size}"
                )
        if db.priority_levels and db.default_priority_level == 0:
            db.default_priority_level = (db.priority_levels + 1) // 2
    for kind, tensors in (("input", config.input), ("output", config.output)):
        seen = set()
        for t in tensors:
            if not t.name:
                raise InvalidArgument(f"model '{name}': an {kind} has no name")
            if t.name in seen:
                raise InvalidArgument(f"model '{name}': {kind} '{t.name}' is declared twice")
            seen.add(t.name)
            if t.data_type == mc.TYPE_INVALID:
                raise InvalidArgument(f"model '{name}': {kind} '{t.name}' has no data_type")
            for d in t.dims:
                if d < -1 or d == 0:
                    raise InvalidArgument(
                        f"model '{name}': {kind} '{t.name}' has dimension {d}; dims must be > 0 or -1"
                    )


def data_type_name(value: int) -> str:
    """'TYPE_FP32' for the enum value."""
    return mc.DataType.Name(value)


_INT64_TYPES = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def to_dict(config: ModelConfig) -> dict:
    """The config as Triton's HTTP `/config` endpoint renders it: proto field names, int64 as numbers."""
    data = json_format.MessageToDict(
        config,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )
    _int64_to_int(config.DESCRIPTOR, data)
    return data


def _int64_to_int(descriptor, data: dict) -> None:
    """protobuf's JSON mapping prints 64-bit integers as strings; Triton prints numbers."""
    for key, value in data.items():
        field = descriptor.fields_by_name.get(key)
        if field is None:
            continue
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            sub = field.message_type
            if sub.GetOptions().map_entry:
                vfield = sub.fields_by_name["value"]
                if vfield.type == FieldDescriptor.TYPE_MESSAGE:
                    for v in value.values():
                        _int64_to_int(vfield.message_type, v)
                elif vfield.type in _INT64_TYPES:
                    for k in value:
                        value[k] = int(value[k])
            elif isinstance(value, list):
                for v in value:
                    _int64_to_int(sub, v)
            else:
                _int64_to_int(sub, value)
        elif field.type in _INT64_TYPES:
            data[key] = [int(v) for v in value] if isinstance(value, list) else int(value)
