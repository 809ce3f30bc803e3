"""The base of every contract model, and strict decoding of contract documents.

Strict means: unknown fields are errors, types are not coerced ("4" is not 4), duplicate JSON keys
and NaN/Infinity are refused, and the document's ``format`` number is checked first so that a
document of another format version gets one clear line instead of a cascade of field errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from coldsnap.contracts.canonical import canonical_json, canonical_sha256, parse_strict_json

__all__ = [
    "Contract",
    "ContractError",
    "Identifier",
    "Sha256Hex",
    "decode_document",
    "load_document",
]

Identifier = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
"""An identity token: letters, digits, '.', '_' and '-', 1 to 128 characters, not starting with a symbol."""

Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
"""A lower-case hex SHA-256 digest."""

NonNegativeInt = Annotated[int, Field(ge=0)]


class Contract(BaseModel):
    """Base of all contract models: strict, closed, immutable, documented field by field.

    Each field's documentation is the docstring under it. pydantic can read those at class creation
    (``use_attribute_docstrings``), but that parses every model's source at import — a tenth of a
    restore's start-up — so :meth:`model_json_schema` reads them only when a schema is asked for."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        validate_default=True,
        # Each model's validator is built when it is first used, not at import: a restore's launcher uses
        # a few of the ~70 models, and it imports all of them before it can start CRIU.
        defer_build=True,
    )

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        """Field name → the docstring under the field in this class or a base (read from the source)."""
        docs: dict[str, str] = {}
        for klass in reversed(cls.__mro__):
            if isinstance(klass, type) and issubclass(klass, Contract) and klass is not Contract:
                docs.update(_attribute_docstrings(klass))
        return docs

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """pydantic's schema, each property described by its field's docstring."""
        schema = super().model_json_schema(*args, **kwargs)
        for name, doc in cls.field_docs().items():
            schema.get("properties", {}).get(name, {}).setdefault("description", doc)
        return schema

    def to_json_value(self) -> dict[str, Any]:
        """This document as plain JSON values (what canonical JSON is computed over)."""
        return self.model_dump(mode="json")

    def canonical_json(self) -> bytes:
        return canonical_json(self.to_json_value())

    def canonical_sha256(self) -> str:
        return canonical_sha256(self.to_json_value())


def _attribute_docstrings(klass: type) -> dict[str, str]:
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for statement, following in zip(body, body[1:]):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


class ContractError(ValueError):
    """A document failed strict decoding; ``problems`` holds one readable line per problem."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__("\n".join(f"{source}: {p}" for p in problems))


ModelT = TypeVar("ModelT", bound=Contract)


def _location(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += ("." if text else "") + str(part)
    return text


def _short(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, bool, type(None))) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def describe_validation_error(error: ValidationError) -> list[str]:
    """One line per pydantic error: ``location: what is wrong``."""
    lines = []
    for item in error.errors(include_url=False):
        # Tagged unions put the tag into the location; it says nothing to a reader.
        loc = tuple(p for p in item["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        kind = item["type"]
        if kind == "extra_forbidden":
            message = "unknown field"
        elif kind == "missing":
            message = "missing required field"
        elif kind in ("model_type", "dict_type") or kind.endswith("_type"):
            message = f"{item['msg'].lower()}, got {_short(item.get('input'))}"
        else:
            message = item["msg"]
            if "input" in item and kind not in ("value_error", "assertion_error"):
                message += f", got {_short(item['input'])}"
        if message.startswith("Value error, "):
            message = message[len("Value error, "):]
        lines.append(f"{_location(loc)}: {message}" if loc else message)
    return lines


def decode_document(model: type[ModelT], data: bytes | str | Any, source: str = "<input>") -> ModelT:
    """Strictly decode ``data`` (JSON text or already-parsed JSON values) as ``model``.

    Raises :class:`ContractError` listing every problem; never anything else for bad input.
    """
    if isinstance(data, (bytes, str)):
        try:
            data = parse_strict_json(data)
        except ValueError as exc:
            raise ContractError(source, [str(exc)]) from None
    if not isinstance(data, dict):
        raise ContractError(source, [f"expected a JSON object, got {type(data).__name__}"])
    supported = getattr(model, "SUPPORTED_FORMATS", None)
    if supported is not None:
        found = data.get("format")
        if "format" not in data:
            raise ContractError(source, [f"format: missing required field (supported: {_list(supported)})"])
        if type(found) is not int or found not in supported:
            raise ContractError(source, [f"format: unsupported format {_short(found)} (supported: {_list(supported)})"])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ContractError(source, describe_validation_error(exc)) from None


def load_document(model: type[ModelT], path: str | Path) -> ModelT:
    """Read and strictly decode a contract document from a file."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ContractError(str(path), [f"cannot read: {exc.strerror or exc}"]) from None
    return decode_document(model, data, str(path))


def _list(values: tuple[int, ...]) -> str:
    return ", ".join(str(v) for v in values)
