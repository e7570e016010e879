"""YAML loading shared by manifests (tessera.manifest) and daemon config files
(tessera.config): safe loading that refuses a key repeated in any mapping."""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["DuplicateKey", "UniqueKeyLoader", "load_unique"]


class DuplicateKey(Exception):
    """A key repeated in a mapping: ``path`` (dotted, e.g. ``workload.steps``) and the
    1-based ``line`` of the repetition."""

    def __init__(self, path: str, line: int) -> None:
        self.path, self.line = path, line


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated in any mapping (plain PyYAML keeps
    the last value silently, so ``steps: 10`` then ``steps: 100000`` would train 100000
    steps): ``DuplicateKey`` with the dotted path of the repeated key and its line. Keys
    brought in by a merge (``<<: *anchor``) may still be overridden, as YAML intends."""

    def construct_document(self, node: yaml.Node) -> Any:
        self._check_unique(node, "", set())
        return super().construct_document(node)

    def _check_unique(self, node: yaml.Node, path: str, seen: set[int]) -> None:
        if id(node) in seen:  # an alias (possibly recursive): checked where it was anchored
            return
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._check_unique(item, f"{path}[{i}]", seen)
        elif isinstance(node, yaml.MappingNode):
            keys: set[Any] = set()
            for k, v in node.value:
                if k.tag == "tag:yaml.org,2002:merge":
                    continue
                if isinstance(k, yaml.ScalarNode):
                    key = self.construct_object(k)
                    name = str(key)
                else:  # a collection as a key: compare by its text
                    key = (k.tag, repr(k.value))
                    name = k.tag
                where = f"{path}.{name}" if path else name
                try:
                    dup = key in keys
                    keys.add(key)
                except TypeError:  # unhashable: validation refuses the document anyway
                    dup = False
                if dup:
                    raise DuplicateKey(where, k.start_mark.line + 1)
                self._check_unique(v, where, seen)


def load_unique(text: str) -> Any:
    """``text`` parsed as ``yaml.safe_load`` would, except that a key repeated in any
    mapping raises ``DuplicateKey``; other errors are ``yaml.YAMLError``."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
