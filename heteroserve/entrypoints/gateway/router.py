"""Routing (model name or alias + service class -> back ends) and balancing among them. Rebuilt on each
config reload; back-end objects are carried over by name so in-flight counts and health survive it."""

from __future__ import annotations

import random
from dataclasses import dataclass

from heteroserve.entrypoints.gateway.backends import Backend
from heteroserve.entrypoints.gateway.config import GatewayConfig, RouteConfig, targets


@dataclass(frozen=True)
class Target:
    """Where a request may go: the model name the back ends know, and the back ends in the route."""

    model: str
    backends: list[Backend]


class Router:
    def __init__(self, config: GatewayConfig, previous: dict[str, Backend] | None = None) -> None:
        self.config = config
        previous = previous or {}
        self.backends: dict[str, Backend] = {}
        for bc in config.backends:
            backend = previous.get(bc.name) or Backend(bc, config.health)
            backend.config, backend.health = bc, config.health
            self.backends[bc.name] = backend
        self._routes: dict[tuple[str, str | None], Target] = {}
        for route in config.routes:
            target = self._target(route)
            for name in (route.model, *route.aliases):
                self._routes[(name, route.service_class)] = target
        for backend in self.backends.values():  # models without a route go to every back end serving them
            for model in backend.config.models:
                if (model, None) not in self._routes:
                    serving = [b for b in self.backends.values() if model in b.config.models]
                    self._routes[(model, None)] = Target(model, serving)

    def _target(self, route: RouteConfig) -> Target:
        return Target(route.model, [self.backends[b.name] for b in targets(self.config, route)])

    def model_names(self) -> list[str]:
        return sorted({name for name, _ in self._routes})

    def resolve(self, model: str, service_class: str | None) -> Target | None:
        """The route for this class, else the class-less route for the model."""
        return self._routes.get((model, service_class)) or self._routes.get((model, None))

    @staticmethod
    def pick(target: Target, tried: set[str]) -> Backend | None:
        """The healthy, untried back end with the least weighted load; ties broken at random."""
        candidates = [b for b in target.backends if b.up and b.name not in tried]
        if not candidates:
            return None
        least = min(b.load() for b in candidates)
        return random.choice([b for b in candidates if b.load() == least])
