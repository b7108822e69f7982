"""Typed dataclass configs built from plain mappings (params.yaml sections).

Every config class is a dataclass that inherits :class:`Config`. Building one from a
mapping checks every key and type and names the offending dotted key in one clear message
(with a did-you-mean for typos); ``validate()`` checks value ranges and impossible
combinations; ``flatten()``/``from_flat()`` round-trip through a flat ``{"a.b": v}`` dict,
which is what MLflow stores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from moe.errors import ConfigError  # noqa: F401 - re-exported: the config's own error


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin in (list, tuple):
        args = get_args(tp)
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"mapping of {_type_name(get_args(tp)[1])}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it in canonical form."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key}: must not be null (expected {_type_name(tp)})")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = get_args(tp)
        if value is None and "none" in choices:  # `--set train.recompute=none` parses as null
            return "none"
        if not any(value == c and type(value) is type(c) for c in choices):
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(repr(c) for c in choices)}{hint}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        (item_tp,) = get_args(tp)[:1] or (Any,)
        items = [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
        _, val_tp = get_args(tp)
        return {str(k): _coerce(v, val_tp, _join(key, str(k))) for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, Config):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping (section {tp.__name__}), got {type(value).__name__} {value!r}")
        return tp.from_dict(value, prefix=key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {type(value).__name__} {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            with contextlib.suppress(ValueError):  # YAML 1.1 reads "1e-3" as a string; accept it as the number it is.
                number = float(value)
        if number is None:
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(number):  # inf/nan would train (or compare) silently as garbage
            raise ConfigError(f"{key}: must be a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):  # YAML reads `account: 12345` as a number
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
    raise TypeError(f"unsupported config annotation {tp!r} at {key}")


def unknown_name_error(key: str, what: str, name: str, known: typing.Iterable[str]) -> ConfigError:
    """``key: unknown <what> 'x' (did you mean 'y'?); known: a, b`` (presets, recipes)."""
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"{key}: unknown {what} {name!r}{hint}; known: {', '.join(known)}")


def unknown_key_error(key: str, name: str, known: typing.Iterable[str]) -> ConfigError:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    hint = f" (did you mean {_join(key.rsplit('.', 1)[0] if '.' in key else '', close[0])!r}?)" if close else ""
    return ConfigError(f"{key}: unknown key{hint}")


@dataclasses.dataclass
class Config:
    """Base of every config section."""

    @classmethod
    def _hints(cls) -> dict[str, Any]:
        return get_type_hints(cls)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, prefix: str = "") -> typing.Self:
        data = dict(data or {})
        data = cls._expand(data, prefix)
        hints = cls._hints()
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        kwargs = {}
        for name, value in data.items():
            key = _join(prefix, str(name))
            if name not in fields:
                raise unknown_key_error(key, str(name), fields)
            kwargs[name] = _coerce(value, hints[name], key)
        return cls(**kwargs)

    @classmethod
    def _expand(cls, data: dict[str, Any], prefix: str) -> dict[str, Any]:
        """Hook for presets: turn e.g. ``{"preset": "x", ...}`` into full data."""
        return data

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = _plain(value)
        return out

    def flatten(self, prefix: str = "") -> dict[str, Any]:
        """``{"model.moe.num_experts": 64, ...}``; lists stay lists."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            key = _join(prefix, f.name)
            if isinstance(value, Config):
                out.update(value.flatten(key))
            else:
                out[key] = _plain(value)
        return out

    @classmethod
    def from_flat(cls, flat: Mapping[str, Any]) -> typing.Self:
        return cls.from_dict(unflatten(flat))

    def validate(self, prefix: str = "") -> typing.Self:
        """Check ranges and combinations, recursively; raise ConfigError naming the key."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Config):
                value.validate(_join(prefix, f.name))
        self._check(prefix)
        return self

    def _check(self, prefix: str) -> None:  # overridden by sections
        return None

    def replace(self, **changes: Any) -> typing.Self:
        return dataclasses.replace(self, **changes)


def _plain(value: Any) -> Any:
    if isinstance(value, Config):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{key}: {message}")


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dotted, value in flat.items():
        set_dotted(out, dotted, value)
    return out


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is a value, cannot set {dotted}")
        node = child
    node[parts[-1]] = value


def parse_value(text: str) -> Any:
    """Parse an override value: JSON/YAML-like scalars and lists, else the raw string."""
    stripped = text.strip()
    lowered = stripped.lower()
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    if lowered in ("null", "none", "~"):
        return None
    try:
        return json.loads(stripped)
    except ValueError:
        pass
    except RecursionError:
        raise ConfigError(f"override value {stripped[:40]!r}...: nested too deeply") from None
    if stripped.startswith("[") and stripped.endswith("]"):
        inner = stripped[1:-1].strip()
        return [parse_value(p.strip()) for p in inner.split(",")] if inner else []
    return text


def apply_overrides(data: Mapping[str, Any], overrides: typing.Iterable[str]) -> dict[str, Any]:
    """Return a deep copy of ``data`` with ``key.path=value`` overrides applied."""
    out = _deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. model.moe.num_experts=16")
        key, value = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {item!r}: empty key")
        set_dotted(out, key, parse_value(value))
    return out


def _deepcopy(data: Any) -> Any:
    if isinstance(data, Mapping):
        return {k: _deepcopy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deepcopy(v) for v in data]
    return data


def deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = _deepcopy(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = _deepcopy(v)
    return out
