"""Structured output for the transformers backend: vLLM's `structured_outputs` ({"json"}, {"json_object"}, {"regex"},
{"choice"}, {"grammar"}) compiled by xgrammar (vLLM's default structured-output engine) against the model's tokenizer,
and followed by masking each constrained row's logits before transformers' continuous batching processes and
samples them.

The mask goes on before temperature, top-k and top-p, so a greedy request takes the best token the grammar allows.
Each step first feeds a constrained request's matcher the tokens it generated since the last step (read from the
request's state, so whatever sampled them, the seed hook included, is what the grammar sees). Once the grammar is
complete only the end-of-generation token is allowed, so the request finishes with `stop`. This wraps
`ModelRunner.logit_processor` of the manager's batch processor (transformers' internals: checked when installed,
as seed.py does).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

from ...errors import InvalidArgument
from ...llm import structured_outputs
from .runner import model_runner

KINDS = ("json", "json_object", "choice", "grammar", "regex")
INSTALL_TIMEOUT_S = (
    30.0  # how long a first constrained request waits for the manager's batch processor to exist
)


@dataclass
class _Constrained:
    matcher: Any  # xgrammar.GrammarMatcher
    consumed: int = 0  # generated tokens already fed to the matcher


class GrammarSampling:
    """The constrained requests of one continuous-batching manager, their matchers and the logits hook."""

    def __init__(self, manager: Any, tokenizer: Any, vocab_size: int):
        self.manager = manager
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.requests: dict[str, _Constrained] = {}
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._installed = False
        self._bitmask: Any = None

    def compile(self, value: Any) -> Any:
        """The compiled grammar of a `structured_outputs` value, or None for none asked (xgrammar caches
        compilations); InvalidArgument naming `structured_outputs` for one it cannot follow."""
        found = structured_outputs.read(value, KINDS, "transformers")
        if found is None:
            return None
        kind, spec = found
        compiler = self._get_compiler()
        try:
            if kind == "json":
                schema = json.dumps(structured_outputs.json_schema(spec))
                return compiler.compile_json_schema(schema, any_whitespace=False)
            if kind == "json_object":  # any object (xgrammar's built-in JSON grammar takes any value)
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False
                )
            if kind == "regex":
                if not isinstance(spec, str) or not spec:
                    raise InvalidArgument("structured_outputs.regex must be a non-empty string")
                return compiler.compile_regex(spec)
            if kind == "choice":
                options = structured_outputs.choices(spec)
                ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in options)
                return compiler.compile_grammar(ebnf)
            return compiler.compile_grammar(structured_outputs.grammar_text(spec))
        except InvalidArgument:
            raise
        except Exception as exc:  # xgrammar's parse and schema errors (RuntimeError, ValueError, its own)
            raise InvalidArgument(
                f"structured_outputs.{kind}: xgrammar cannot compile it: {str(exc).strip().splitlines()[0]}"
            ) from None

    def register(self, request_id: str, compiled: Any) -> None:
        """Constrain `request_id` by `compiled` (call before adding the request to the manager)."""
        import xgrammar

        self._install()
        self.requests[request_id] = _Constrained(xgrammar.GrammarMatcher(compiled))

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar
                except ImportError:
                    raise InvalidArgument(
                        "structured output on the transformers backend needs xgrammar (pip install "
                        "'naiad[transformers]')"
                    ) from None
                info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def _install(self) -> None:
        with self._lock:
            if self._installed:
                return
            runner = model_runner(self.manager, "'structured_outputs'", "logit_processor")
            processors = runner.logit_processor
            if not getattr(processors, "do_processing", False):
                raise InvalidArgument(
                    "the transformers backend's logits processors are off: no structured output"
                )
            runner.logit_processor = _MaskFirst(processors, lambda logits: self._mask(runner, logits))
            self._installed = True

    def _mask(self, runner: Any, logits: Any) -> None:
        """Mask, in place, the rows of `logits` (one per request predicting a token, in batch order) whose request
        is constrained."""
        if not self.requests:
            return
        import xgrammar

        states = [fs.state for fs in runner.inputs_and_outputs.requests_in_batch if fs.has_new_token]
        rows = []
        for row, state in enumerate(states[: logits.shape[0]]):
            constrained = self.requests.get(state.request_id)
            if constrained is None:
                continue
            for token in state.generated_tokens[constrained.consumed :]:
                constrained.matcher.accept_token(int(token))
            constrained.consumed = len(state.generated_tokens)
            rows.append((row, constrained))
        if not rows:
            return
        if self._bitmask is None or self._bitmask.shape[0] < logits.shape[0]:
            self._bitmask = xgrammar.allocate_token_bitmask(max(logits.shape[0], 16), self.vocab_size)
        for row, constrained in rows:
            constrained.matcher.fill_next_token_bitmask(self._bitmask, row)
        indices = [row for row, _ in rows]
        xgrammar.apply_token_bitmask_inplace(
            logits, self._bitmask.to(logits.device), vocab_size=self.vocab_size, indices=indices
        )


class _MaskFirst:
    """A logits-processor list that masks the logits before the processors run (attributes are the list's)."""

    def __init__(self, inner: Any, mask: Any):
        self._inner = inner
        self._mask = mask

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __call__(self, input_ids: Any, logits: Any, *args: Any, **kwargs: Any) -> Any:
        self._mask(logits)
        return self._inner(input_ids, logits, *args, **kwargs)
