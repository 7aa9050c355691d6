"""An LLM InferenceModel's `llm.loraAdapters` reach the pods as the llamacpp backend's `lora_adapters` parameter in
the load config (stable and canary; a change is a new revision, reloaded live); bad names, paths, engines and a
second place for the same setting are problems. tests/test_llamacpp_lora.py loads such a config into a real server."""

from __future__ import annotations

from naiad_operator.model_resources import model_intent

STORAGE = {"uri": "pvc://models/repository"}


def spec_of(adapters, engine: str = "llamacpp", **extra) -> dict:
    return {
        "modelName": "tiny",
        "storage": STORAGE,
        "llm": {"engine": engine, "loraAdapters": adapters},
        **extra,
    }


def test_adapters_become_the_lora_adapters_parameter_of_the_load_config():
    spec = spec_of([{"name": "sql", "path": "adapters/sql.gguf"}, {"name": "chat.v2", "path": "chat.gguf"}])
    intent = model_intent("llama", spec)
    assert intent.problems == []
    assert intent.load_config == {
        "backend": "llamacpp",
        "parameters": {"lora_adapters": {"string_value": "sql=adapters/sql.gguf,chat.v2=chat.gguf"}},
    }
    assert intent.llm is not None and intent.llm.lora_adapters == (
        ("sql", "adapters/sql.gguf"),
        ("chat.v2", "chat.gguf"),
    )
    # another adapter is another revision: the pods reload the model with it
    more = model_intent("llama", spec_of([{"name": "sql", "path": "adapters/sql.gguf"}]))
    assert more.revision != intent.revision
    # the user's own config keeps its other settings
    mixed = model_intent(
        "llama",
        spec_of(
            [{"name": "sql", "path": "sql.gguf"}],
            config={"parameters": {"n_ctx": {"string_value": "4096"}}},
        ),
    )
    assert mixed.load_config == {
        "backend": "llamacpp",
        "parameters": {
            "n_ctx": {"string_value": "4096"},
            "lora_adapters": {"string_value": "sql=sql.gguf"},
        },
    }


def test_no_adapters_leave_the_load_config_alone():
    assert model_intent("llama", spec_of([])).load_config is None
    assert model_intent("llama", {"llm": {"engine": "llamacpp"}}).load_config is None


def test_a_canary_gets_the_adapters_too():
    spec = spec_of([{"name": "sql", "path": "sql.gguf"}], canary={"version": 2, "trafficPercent": 10})
    intent = model_intent("llama", spec)
    assert intent.problems == [] and intent.canary is not None
    assert intent.canary.load_config["parameters"] == {"lora_adapters": {"string_value": "sql=sql.gguf"}}


def test_bad_adapters_are_problems():
    def problems(adapters, engine="llamacpp", **extra):
        return model_intent("llama", spec_of(adapters, engine, **extra)).problems

    (p,) = problems({"name": "sql"})
    assert "must be a list" in p
    (p,) = problems([{"name": "sql", "path": "sql.gguf"}], engine="vllm")
    assert "'vllm' engine does not take adapters" in p and "multi_lora.json" in p
    (p,) = problems([{"name": "has space", "path": "a.gguf"}])
    assert "name must be letters" in p
    (p,) = problems([{"name": "a", "path": "a.gguf"}, {"name": "a", "path": "b.gguf"}])
    assert "given twice" in p
    for path in ("/abs/a.gguf", "../a.gguf", "x/../../a.gguf", "a,b.gguf", "a=b.gguf", ""):
        (p,) = problems([{"name": "a", "path": path}])
        assert "relative to the model's version folder" in p, path
    (p,) = problems(["sql"])
    assert "must be {name, path}" in p
    (p,) = problems(
        [{"name": "a", "path": "a.gguf"}],
        config={"parameters": {"lora_adapters": {"string_value": "b=b.gguf"}}},
    )
    assert "not both" in p
