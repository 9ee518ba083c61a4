"""Third-party platforms, found through the `heteroserve.platforms` entry-point group.

As with vLLM's `vllm.platform_plugins`, each entry point names a function that returns the qualified name
of the platform class ("package.module.Class"), or None when the plugin's device is not present. The
function should be cheap: it runs whenever platforms are detected, before any model is loaded.

    [project.entry-points."heteroserve.platforms"]
    mydevice = "heteroserve_mydevice:register"
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from dataclasses import dataclass
from typing import TypeVar

from heteroserve.platforms.interface import Platform

T = TypeVar("T")

logger = logging.getLogger(__name__)

GROUP = "heteroserve.platforms"


@dataclass
class PluginPlatform:
    name: str  # the entry point's name: what --device selects
    distribution: str
    cls: type[Platform] | None  # None: the plugin reports no device here, or failed to load
    error: str | None = None


def load_class(qualname: str, base: type[T] = Platform) -> type[T]:
    """The class a dotted name ("package.module.Class") names, which must subclass `base`."""
    module_name, _, class_name = qualname.rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"{qualname} is not a heteroserve {base.__name__} subclass")
    return cls


def discover_plugins() -> list[PluginPlatform]:
    """Every installed plugin; one that fails to load is reported, not raised, so others still work."""
    plugins = []
    for ep in importlib.metadata.entry_points(group=GROUP):
        distribution = ep.dist.name if ep.dist is not None else ep.value
        try:
            qualname = ep.load()()
            cls = load_class(qualname) if qualname else None
            plugins.append(PluginPlatform(ep.name, distribution, cls))
        except Exception as exc:  # a broken plugin must not stop the built-in platforms
            logger.warning("platform plugin %s (%s) failed to load: %s", ep.name, distribution, exc)
            plugins.append(PluginPlatform(ep.name, distribution, None, f"{type(exc).__name__}: {exc}"))
    return plugins
