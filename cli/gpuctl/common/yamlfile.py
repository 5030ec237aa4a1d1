"""Reading a user's YAML file (task, config, inventory) with one-line errors and bounded work.

cluster.yaml has its own builder (spec/compose.py) because it maps every field to its line;
both check the text first with `check_printable`, so a NUL or another control
byte is one clear line instead of PyYAML's ReaderError, and both compose with
`compose_bounded`, so neither a deep nesting nor an alias bomb can exhaust the
stack or the memory: such a file is one line and exit 2 like any other bad input.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import yaml
from yaml.reader import Reader

from gpuctl.common.errors import UserError

# Deeper than any gpuctl file needs (a task or an inventory is under 10 levels), and
# shallow enough that composing and building recurse far below Python's limit.
MAX_DEPTH = 100
# Nodes that aliases and merge keys may add to what is written: plenty for anchors of
# shared settings, far below the millions of a "billion laughs" document.
MAX_ALIAS_NODES = 100_000
MAX_ALIAS_BYTES = 16 << 20  # characters of scalars that aliases may add: one long string aliased 10^5 times


def check_printable(text: str, source: str) -> None:
    """One line naming the first character YAML does not allow (NUL, other control bytes)."""
    match = Reader.NON_PRINTABLE.search(text)
    if match is None:
        return
    pos = match.start()
    line = text.count("\n", 0, pos) + 1
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    raise UserError(f"{source}:{line}:{column}: control character U+{ord(match.group()):04X} is not allowed in "
                    f"YAML; remove it (was the file saved as binary or UTF-16?)")


def read_text(path: Path, *, what: str, source: str | None = None) -> str:
    """The file's text as UTF-8; a missing, unreadable or binary file is one line
    naming `source` (the path as the user wrote it; default `path`)."""
    name = source or str(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{name}: no such file; {what} expected there") from None
    except IsADirectoryError:
        raise UserError(f"{name}: is a directory; give the {what}") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{name}: byte {exc.start} is not UTF-8; the {what} must be UTF-8 text") from None
    except OSError as exc:
        raise UserError(f"{name}: cannot read it ({exc.strerror})") from None


class BoundedLoader(yaml.SafeLoader):
    """SafeLoader whose composer refuses nesting deeper than MAX_DEPTH.

    PyYAML's scanner and parser are iterative, its composer recursive: counting
    here stops 100,000 `[` at level MAX_DEPTH, long before Python's recursion limit.
    """

    def __init__(self, stream: str, source: str) -> None:
        super().__init__(stream)
        self.source = source
        self._depth = 0
        self.last_node: yaml.Node | None = None  # the innermost node being constructed: where a value failed

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        self.last_node = node
        return super().construct_object(node, deep=deep)

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise UserError(f"{_at(self.source, self.peek_event().start_mark)}: nested deeper than {MAX_DEPTH} "
                                "levels; flatten the file (gpuctl's files need only a few)")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _at(source: str, mark: yaml.Mark | None) -> str:
    return f"{source}:{mark.line + 1}" if mark is not None else source


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def check_expansion(root: yaml.Node, source: str) -> None:
    """Refuse a composed document whose aliases would expand past the bounds.

    Composing keeps one node per anchor, so this walk is linear in the file:
    each distinct node once (iteratively, no recursion), its size, depth and
    characters as the expanded tree would have them. Refused: an alias inside
    its own anchor, an expanded depth over MAX_DEPTH (chains of anchors), more
    than MAX_ALIAS_NODES nodes or MAX_ALIAS_BYTES characters of scalars added by
    aliases and merge keys (`<<: *a`): loading shares them, but every later step
    that writes the values out (env exports, the job's JSON) would not.
    """
    sizes: dict[int, int] = {}
    depths: dict[int, int] = {}
    chars: dict[int, int] = {}
    written = 0  # characters of the distinct scalars seen so far
    entered: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            kids = _children(node)
            sizes[key] = 1 + sum(sizes[id(kid)] for kid in kids)
            depths[key] = 1 + max((depths[id(kid)] for kid in kids), default=0)
            own = len(node.value) if isinstance(node, yaml.ScalarNode) else 0
            written += own
            chars[key] = own + sum(chars[id(kid)] for kid in kids)
            entered.discard(key)
            if depths[key] > MAX_DEPTH:
                raise UserError(f"{_at(source, node.start_mark)}: YAML aliases nest deeper than {MAX_DEPTH} levels "
                                "when expanded; write the values out instead of chaining anchors")
            if sizes[key] > len(sizes) + MAX_ALIAS_NODES:
                raise UserError(f"{_at(source, node.start_mark)}: YAML aliases expand to more than "
                                f"{MAX_ALIAS_NODES:,} nodes (an alias bomb?); use fewer aliases or write the "
                                "values out")
            if chars[key] > written + MAX_ALIAS_BYTES:
                raise UserError(f"{_at(source, node.start_mark)}: YAML aliases expand to more than "
                                f"{MAX_ALIAS_BYTES >> 20} MiB of text (an alias bomb?); use fewer aliases or write "
                                "the values out")
            continue
        if key in sizes:
            continue
        if key in entered:  # entered and not finished: an ancestor of the alias
            raise UserError(f"{_at(source, node.start_mark)}: a YAML alias refers to itself")
        entered.add(key)
        stack.append((node, True))
        stack.extend((kid, False) for kid in _children(node) if id(kid) not in sizes)


def compose_bounded(loader: BoundedLoader) -> yaml.Node | None:
    """The loader's single document as nodes (None when empty), within the bounds."""
    root = loader.get_single_node()
    if root is not None:
        check_expansion(root, loader.source)
    return root


@contextmanager
def constructing(loader: BoundedLoader) -> Iterator[None]:
    """What YAML's constructors raise besides YAMLError, as one line naming the file and the
    value's line: an integer of thousands of digits, a date such as 2024-13-45, or (should
    the bounds ever let one through) an exhausted stack or memory."""
    try:
        yield
    except (ValueError, OverflowError) as exc:
        where = _at(loader.source, loader.last_node.start_mark if loader.last_node is not None else None)
        raise UserError(f"{where}: a value YAML cannot read ({_short(exc)}); quote it to make it a string") from None
    except RecursionError:
        raise UserError(f"{loader.source}: nested too deeply to read; flatten the file") from None
    except MemoryError:
        raise UserError(f"{loader.source}: too large to read in memory; make the file smaller") from None


def _short(exc: BaseException) -> str:
    text = str(exc).split(";")[0]
    return text if len(text) <= 120 else text[:117] + "..."


def load_yaml(path: Path, *, what: str) -> Any:
    """The parsed document (None for an empty file); a syntax error names the
    file, line and column, and `what` the file is."""
    text = read_text(path, what=what)
    check_printable(text, str(path))
    loader = BoundedLoader(text, str(path))
    try:
        with constructing(loader):
            root = compose_bounded(loader)
            return None if root is None else loader.construct_document(root)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        pos = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"{path}: YAML syntax error{pos}; fix the {what}") from None
    finally:
        loader.dispose()
