"""A task YAML composed with the line of every key, so an error can say `FILE:LINE`.

Why a module of its own: PyYAML's loader forgets where a value was written;
`_compose` keeps a map from each key's dotted path to its line (and the text of
plain scalars, so `VERSION: 1.10` stays "1.10"), within yamlfile's bounds.
`_as_written` and `_line_of` look a field up in that map.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from gpuctl.common.errors import UserError
from gpuctl.common.yamlfile import BoundedLoader, check_printable, compose_bounded, constructing
from gpuctl.spec.fields import _RESOURCE_ALIASES, _kind

# A field by its dotted path as written: ("resources", "accelerators").
_Path = tuple[str, ...]


def _compose(text: str, source: str) -> tuple[Any, dict[_Path, int], dict[_Path, str]]:
    """Parse `text`; return the data, the line of every key/item as written (by dotted
    path), and the written text of every plain non-string scalar (for envs values).

    The document is composed within yamlfile's bounds (depth, alias expansion), so
    building it recurses at most MAX_DEPTH deep. What an alias or merge key brings
    in gets no lines of its own (it is found at the line of the field that uses
    it), so the line map grows with the file, not with the expansion.
    """
    check_printable(text, source)
    loader = BoundedLoader(text, source)
    lines: dict[_Path, int] = {(): 1}
    texts: dict[_Path, str] = {}
    built: set[int] = set()  # nodes already built once: a second visit is through an alias

    def line(node: yaml.Node) -> int:
        return node.start_mark.line + 1

    def key_of(node: yaml.Node) -> Any:
        key = loader.construct_object(node, deep=True)
        if isinstance(key, (dict, list, set)):
            raise UserError(f"{source}:{line(node)}: a key must be a plain name, not {_kind(key)}")
        return key

    def build(node: yaml.Node, path: _Path, written: bool) -> Any:
        first = id(node) not in built
        built.add(id(node))
        written = written and first
        if isinstance(node, yaml.ScalarNode):
            value = loader.construct_object(node, deep=True)
            if node.style is None and value is not None and not isinstance(value, str):
                texts[path] = node.value
            return value
        if isinstance(node, yaml.SequenceNode):
            items = []
            for index, item in enumerate(node.value):
                if written and id(item) not in built:  # an alias item's mark is its anchor's line
                    lines[path + (str(index),)] = line(item)
                items.append(build(item, path + (str(index),), written))
            return items
        first_seen: dict[str, int] = {}
        # Once: an alias to this mapping finds it flattened, its merged keys beside its own.
        for key_node, _ in node.value if first else ():
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` keys may be overridden; only repeats of written keys are errors
            name = str(key_of(key_node))
            if name in first_seen:
                raise UserError(f"{source}:{line(key_node)}: {'.'.join(path + (name,))}: duplicate key "
                                f"(first on line {first_seen[name]}); give each field once")
            first_seen[name] = line(key_node)
        loader.flatten_mapping(node)
        mapping: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = key_of(key_node)
            if written and str(key) in first_seen:  # merged-in keys are the anchor's, not written here
                lines[path + (str(key),)] = line(key_node)
            mapping[key] = build(value_node, path + (str(key),), written)
        return mapping

    try:
        with constructing(loader):
            root = compose_bounded(loader)
            if root is None:
                return None, lines, texts
            lines[()] = line(root)
            return build(root, (), True), lines, texts
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        if isinstance(err, yaml.composer.ComposerError) and "single document" in str(err.context):
            raise UserError(f"{where}: more than one YAML document (---): a SkyPilot pipeline; `gpuctl jobs launch "
                            f"{source}` runs its stages one after another as one managed job (`gpuctl validate` "
                            "checks them)") from None
        hint = "; indent with spaces, not tabs" if "\\t" in str(err.problem) else ""
        raise UserError(f"{where}: YAML syntax error: {err.problem or err.context}{hint}") from None
    except yaml.YAMLError as err:
        raise UserError(f"{source}: YAML error: {err}") from None
    finally:
        loader.dispose()


def _as_written(lines: Mapping[_Path, int], key: tuple[str, ...]) -> tuple[str, ...]:
    """`key` with each part spelled as the file spells it (an alias such as gpus, spot_recovery)."""
    out: tuple[str, ...] = ()
    for part in key:
        if out + (part,) not in lines:
            aliases = [a for a, name in _RESOURCE_ALIASES.items() if name == part and out + (a,) in lines]
            part = aliases[0] if aliases else part
        out += (part,)
    return out


def _line_of(lines: Mapping[_Path, int], key: tuple[str, ...]) -> int:
    return next(lines[key[:n]] for n in range(len(key), -1, -1) if key[:n] in lines)
