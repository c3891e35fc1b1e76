"""Per-request generation parameters: the TensorRT-LLM backend's inputs, checked at the edge.

The ensemble (and ``tensorrt_llm_bls``) take the backend's input names; each is
honoured, accepted only at its neutral value, or refused with an error naming the
input and the value (see ``HONOURED``, ``NEUTRAL``, ``REFUSED``). Requests are
batched as in the backend (``[batch, 1]`` tensors): :meth:`GenerationParams.from_tensors`
reads one row. Past the frontend the parameters travel as JSON
(:meth:`GenerationParams.to_json`) and each node checks them again.

Two sampling conventions meet here. Inside (:class:`GenerationParams`) a ``temperature``
of zero is greedy and above zero samples, as in OpenAI's API, whose server builds the
parameters directly. A Triton request follows TensorRT-LLM's (:func:`trtllm_sampling`):
greedy unless ``top_k > 1`` or ``top_p > 0``, whatever the temperature, which then
applies only when sampling.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch stays out of processes that only check (the OpenAI API)
    from orchestrator.engine.sampling import SamplingParams


class RequestError(ValueError):
    """A request that cannot be served as given; the message names what is wrong."""


MAX_RETURN_SEQUENCES = 16
MAX_TOP_LOG_PROBS = 5  # alternatives per token a request may ask for
MAX_WORDS = 64  # stop or bad words per request
MAX_WORDS_BYTES = 16_384  # their text, all together (checked before parsing)
MAX_CACHE_SALT_BYTES = 256
_U64 = 2**64

# input -> kind of its one value: "int", "float" or "bool"
HONOURED: dict[str, str] = {
    "max_tokens": "int",
    "end_id": "int",
    "pad_id": "int",
    "temperature": "float",
    "top_k": "int",
    "top_p": "float",
    "seed": "int",
    "random_seed": "int",  # the backend's older name of seed
    "min_tokens": "int",
    "min_length": "int",  # the backend's older name of min_tokens
    "repetition_penalty": "float",
    "presence_penalty": "float",
    "frequency_penalty": "float",
    "exclude_input_in_output": "bool",
    "num_return_sequences": "int",
    "return_log_probs": "bool",
    "top_log_probs": "int",  # this project's own: alternatives per token, with their log-probs
    "return_perf_metrics": "bool",
    "stream": "bool",
    "cache_salt": "str",  # vLLM's: prompts share cached KV only under the same salt
}
# Accepted only at the value that changes nothing here (no beam search, no logits out).
NEUTRAL: dict[str, tuple[str, object]] = {
    "beam_width": ("int", 1),
    "length_penalty": ("float", None),  # beam search only: no effect at beam_width 1
    "return_context_logits": ("bool", False),
    "return_generation_logits": ("bool", False),
}
# Refused whenever they hold a value (empty tensors and empty strings pass).
REFUSED: dict[str, str] = {
    "prompt_embedding_table": "prompt tables (p-tuning)",
    "prompt_table_extra_id": "prompt tables (p-tuning)",
    "prompt_vocab_size": "prompt tables (p-tuning)",
    "lora_task_id": "LoRA adapters",
    "lora_weights": "LoRA adapters",
    "lora_config": "LoRA adapters",
    "guided_decoding_guide_type": "guided decoding",
    "guided_decoding_guide": "guided decoding",
    "embedding_bias_words": "embedding bias",
    "embedding_bias_weights": "embedding bias",
    "decoder_text_input": "encoder-decoder models",
    "image_input": "multimodal input",
    "image_bytes_input": "multimodal input",
    "image_url_input": "multimodal input",
    "video_bytes_input": "multimodal input",
    "num_draft_tokens": "speculative decoding",
    "use_draft_logits": "speculative decoding",
}
# Made by preprocessing from the text inputs stop_words / bad_words: JSON token lists.
WORD_TENSORS = ("stop_ids", "bad_ids")
INPUTS = (*HONOURED, *NEUTRAL, *REFUSED, *WORD_TENSORS)

Words = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int
    end_id: int | None = None
    pad_id: int | None = None
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh one per request
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_words: Words = ()
    bad_words: Words = ()
    exclude_input_in_output: bool = False
    num_return_sequences: int = 1
    return_log_probs: bool = False
    top_log_probs: int = 0
    return_perf_metrics: bool = False
    stream: bool = False
    cache_salt: str = ""  # "" : no salt (the cache shared by every request without one)
    # The frontend's, re-attaching a request whose head was lost to the new head: the
    # tokens its client has already (empty: a new request).
    delivered: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("stop_words", "bad_words"):  # JSON gives lists back
            object.__setattr__(self, name, tuple(tuple(w) for w in getattr(self, name)))
        object.__setattr__(self, "delivered", tuple(self.delivered))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def sampling(self, prompt_ids: Sequence[int]) -> SamplingParams:
        """The sampler's parameters; every node of one request must get the same seed
        (the frontend fixes it: :meth:`for_sequence`)."""
        from orchestrator.engine.sampling import SamplingParams

        seed = random.getrandbits(63) if self.seed is None else self.seed % 2**63
        return SamplingParams(
            self.temperature, self.top_k, self.top_p, seed, self.min_tokens, self.end_id,
            self.repetition_penalty, self.presence_penalty, self.frequency_penalty,
            self.bad_words, log_probs=self.return_log_probs, top_log_probs=self.top_log_probs,
        ).for_prompt(prompt_ids)

    def for_sequence(self, index: int) -> GenerationParams:
        """Sample ``index`` of ``num_return_sequences``: its own seed, derived from the
        request's, so the samples differ and a seeded request repeats."""
        seed = random.getrandbits(63) if self.seed is None else self.seed
        return replace(self, seed=(seed + index) % _U64, num_return_sequences=1)

    # -- on the wire -----------------------------------------------------------------

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, np.ndarray | None], row: int | None = None
                     ) -> GenerationParams:
        """Row ``row`` of a batched request's inputs (``None``: unbatched ``[1]`` tensors);
        absent inputs take their defaults. Raises RequestError naming the input."""
        values: dict[str, object] = {}
        for name, array in tensors.items():
            if array is None or name not in INPUTS:
                continue
            array = np.asarray(array if row is None else array[row])
            if name in REFUSED:
                _refuse(name, array)
            elif name in WORD_TENSORS:
                values["stop_words" if name == "stop_ids" else "bad_words"] = _words(name, array)
            elif name in NEUTRAL:
                kind, neutral = NEUTRAL[name]
                value = _one(name, array, kind)
                if neutral is not None and value != neutral:
                    raise RequestError(f"{name} {value!r} is not supported: only {neutral!r} "
                                       f"({'no beam search' if kind == 'int' else 'no logits'} "
                                       "here)")
            else:
                values[name] = _one(name, array, HONOURED[name])
        for old, new in (("random_seed", "seed"), ("min_length", "min_tokens")):
            if old in values:
                value = values.pop(old)
                if values.setdefault(new, value) != value:
                    raise RequestError(f"{old} {value} and {new} {values[new]} disagree: "
                                       f"send {new} alone")
        if "max_tokens" not in values:
            raise RequestError("max_tokens is required")
        trtllm_sampling(values)
        if values.get("end_id") == -1:  # the backend's "no end id"
            del values["end_id"]
        if values.get("pad_id") == -1:
            del values["pad_id"]
        params = cls(**values)
        params.check()
        return params

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: np.ndarray | bytes | str | None) -> GenerationParams:
        """From :meth:`to_json`, or the ``params`` tensor that carries it."""
        if data is None:
            raise RequestError("params (the request's parameters as JSON) is required")
        if isinstance(data, np.ndarray):
            data = data.reshape(-1)[0]
        try:
            params = cls(**json.loads(data))
        except (TypeError, ValueError) as exc:
            raise RequestError(f"malformed parameters: {exc}") from None
        params.check()
        return params

    def check(self) -> None:
        """Ranges that need no model; the vocabulary's are in :func:`check_prompt`."""
        _check_temperature(self.temperature)
        for name in ("top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise RequestError(f"{name} must be a finite number, got {value}")
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise RequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be in [0, max_tokens {self.max_tokens}], "
                               f"got {self.min_tokens}")
        if self.seed is not None and not 0 <= self.seed < _U64:
            raise RequestError(f"seed must be in [0, 2^64), got {self.seed}")
        if not 0 <= self.top_log_probs <= MAX_TOP_LOG_PROBS:
            raise RequestError(f"top_log_probs must be in [0, {MAX_TOP_LOG_PROBS}], "
                               f"got {self.top_log_probs}")
        if self.top_log_probs and not self.return_log_probs:
            raise RequestError(f"top_log_probs {self.top_log_probs} needs return_log_probs "
                               "true")
        if not isinstance(self.cache_salt, str) or len(
                self.cache_salt.encode("utf-8", "surrogatepass")) > MAX_CACHE_SALT_BYTES:
            raise RequestError(f"cache_salt must be a string of at most {MAX_CACHE_SALT_BYTES} "
                               "bytes")
        if not 1 <= self.num_return_sequences <= MAX_RETURN_SEQUENCES:
            raise RequestError(f"num_return_sequences must be in [1, {MAX_RETURN_SEQUENCES}], "
                               f"got {self.num_return_sequences}")


def trtllm_sampling(values: dict[str, object]) -> None:
    """TensorRT-LLM's sampling rule, in place on a request's ``values``: sampling only if
    ``top_k > 1`` or ``top_p > 0`` (a client's ``temperature`` 1.0 with neither set is
    greedy, as its backend gives it); ``top_k`` 0 and ``top_p`` 0 mean "no cut"."""
    top_k, top_p = int(values.get("top_k", 0)), float(values.get("top_p", 0.0))
    if top_k < 0:
        raise RequestError(f"top_k must be >= 0, got {top_k}")
    if not 0.0 <= top_p <= 1.0:  # NaN fails too
        raise RequestError(f"top_p must be in [0, 1], got {top_p}")
    sampling = top_k > 1 or top_p > 0
    temperature = float(values.get("temperature", 1.0 if sampling else 0.0))
    _check_temperature(temperature)
    if sampling and temperature > 0:
        values.update(top_k=top_k, top_p=top_p or 1.0, temperature=temperature)
    else:  # greedy: one form of it, so equal requests compare equal
        values.update(top_k=0, top_p=1.0, temperature=0.0)


def _check_temperature(value: float) -> None:
    if not math.isfinite(value):
        raise RequestError(f"temperature must be a finite number, got {value}")
    if value < 0:
        raise RequestError(f"temperature must be >= 0, got {value}")


def _one(name: str, array: np.ndarray, kind: str) -> int | float | bool | str:
    if array.size != 1:
        raise RequestError(f"{name} must hold one value per row, got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    accepted = {"int": "iu", "float": "fiu", "bool": "b", "str": "OSU"}[kind]
    if array.dtype.kind not in accepted or kind == "str" and not isinstance(value, bytes | str):
        raise RequestError(f"{name} must be {kind}, got {array.dtype} value {value!r}")
    if kind == "str":
        try:
            return value.decode() if isinstance(value, bytes) else str(value)
        except UnicodeDecodeError:
            raise RequestError(f"{name} is not UTF-8") from None
    return {"int": int, "float": float, "bool": bool}[kind](value)


def _refuse(name: str, array: np.ndarray) -> None:
    refuse(name, array, REFUSED[name])


def refuse(name: str, array: np.ndarray, what: str) -> None:
    """Raises RequestError if ``array`` holds a value: ``what`` is not supported here."""
    values = [v for v in array.reshape(-1).tolist() if v not in (b"", "")]
    if values:
        shown = values[0] if len(values) == 1 else f"{len(values)} values"
        raise RequestError(f"{name} ({shown!r}) is refused: {what} are not "
                           "supported by this server")


def _words(name: str, array: np.ndarray) -> Words:
    value = array.reshape(-1)
    if value.size != 1:
        raise RequestError(f"{name} must hold one JSON list per row")
    try:
        words = tuple(tuple(int(t) for t in w) for w in json.loads(value[0]) if w)
    except (TypeError, ValueError) as exc:
        raise RequestError(f"{name} is not a JSON list of token lists: {exc}") from None
    if len(words) > MAX_WORDS:
        raise RequestError(f"{len(words)} {name.replace('_ids', '_words')}: at most {MAX_WORDS}")
    return words


def as_text(value: bytes | str) -> str:
    """A BYTES tensor's element as a string (numpy holds bytes, or str when built from it)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_words(values: Sequence[bytes | str]) -> list[str]:
    """The backend's string form of ``stop_words`` / ``bad_words``: each element one word,
    or several joined by commas (quote a word that holds a comma, as in CSV). Refused by
    count and size before any is parsed, so a huge list costs no parsing or tokenizing."""
    import csv

    what = "stop_words / bad_words"
    if len(values) > MAX_WORDS:
        raise RequestError(f"{what}: {len(values)} values, at most {MAX_WORDS}")
    raw = [v if isinstance(v, bytes) else str(v).encode("utf-8", "surrogatepass")
           for v in values]
    size = sum(map(len, raw))
    if size > MAX_WORDS_BYTES:
        raise RequestError(f"{what}: {size} bytes, at most {MAX_WORDS_BYTES}")
    words = []
    try:
        for value in raw:
            for line in csv.reader([value.decode("utf-8")], skipinitialspace=False):
                words += [w for w in line if w]
    except UnicodeDecodeError as exc:
        raise RequestError(f"{what}: not UTF-8 ({exc})") from None
    except csv.Error as exc:  # e.g. a NUL byte
        raise RequestError(f"{what}: not comma-separated words ({exc})") from None
    if len(words) > MAX_WORDS:
        raise RequestError(f"{what}: {len(words)} words, at most {MAX_WORDS}")
    return words


def check_prompt(
    prompt_ids: list[int], params: GenerationParams, max_seq_len: int, vocab_size: int
) -> None:
    """The prompt must be valid token ids, and it plus every new token must fit a KV slot;
    end_id and pad_id must be in the vocabulary."""
    n = len(prompt_ids)
    if n == 0:
        raise RequestError("empty prompt: at least one token is needed")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    for name in ("end_id", "pad_id"):
        value = getattr(params, name)
        if value is not None and not 0 <= value < vocab_size:
            raise RequestError(f"{name} {value} outside the vocabulary [0, {vocab_size})")
    if n > max_seq_len:
        raise RequestError(f"prompt of {n} tokens does not fit the context of {max_seq_len}")
    # The last new token is returned but never fed back, so it takes no KV position.
    if n + params.max_tokens - 1 > max_seq_len:
        raise RequestError(
            f"prompt of {n} tokens + max_tokens {params.max_tokens} exceeds "
            f"the context of {max_seq_len} tokens"
        )
