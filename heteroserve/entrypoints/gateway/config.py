"""The gateway's YAML config as pydantic models, validated as a whole at start and on reload, so a bad
file is refused with the path of the bad field instead of failing on the first request that needs it."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the bad field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key is an error, not a silent default


class BackendConfig(_Strict):
    name: str = Field(min_length=1)
    url: str = Field(pattern=r"^https?://[^/\s]+(/\S*)?$", description="base URL, without /v1")
    models: list[str] = Field(min_length=1)
    labels: dict[str, str] = Field(default_factory=dict)
    weight: float = Field(1.0, gt=0)
    api_key: str | None = None


class RouteConfig(_Strict):
    """Requests for `model` (or an alias) in `service_class` (None: any class) go to the back ends named
    in `backends` plus those whose labels include all of `selector`."""

    model: str
    aliases: list[str] = Field(default_factory=list)
    service_class: str | None = None
    backends: list[str] = Field(default_factory=list)
    selector: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _has_targets(self) -> RouteConfig:
        if not self.backends and not self.selector:
            raise ValueError("give backends or selector (or both)")
        return self


class ApiKeyConfig(_Strict):
    key: str = Field(min_length=1)
    service_class: str | None = None


class HealthConfig(_Strict):
    path: str = "/health"
    interval: float = Field(5.0, gt=0, description="seconds between active checks")
    timeout: float = Field(2.0, gt=0)
    failure_threshold: int = Field(3, ge=1, description="consecutive 5xx answers that open the breaker")
    cooldown: float = Field(5.0, ge=0, description="seconds an open breaker stays open before a probe may close it")


class GatewayConfig(_Strict):
    backends: list[BackendConfig] = Field(min_length=1)
    routes: list[RouteConfig] = Field(default_factory=list)
    api_keys: list[ApiKeyConfig] = Field(default_factory=list)
    default_service_class: str | None = None
    health: HealthConfig = Field(default_factory=HealthConfig)
    max_attempts: int = Field(3, ge=1, description="back ends tried for a request that fails before its first byte")
    connect_timeout: float = Field(5.0, gt=0)
    read_timeout: float = Field(600.0, gt=0, description="seconds without a byte from the back end")

    @model_validator(mode="after")
    def _consistent(self) -> GatewayConfig:
        names = [b.name for b in self.backends]
        if len(set(names)) != len(names):
            raise ValueError(f"backend names must be unique: {names}")
        by_name = {b.name: b for b in self.backends}
        for i, route in enumerate(self.routes):
            where = f"routes.{i}"
            for name in route.backends:
                if name not in by_name:
                    raise ValueError(f"{where}.backends: no backend named {name!r}")
            if not targets(self, route):
                raise ValueError(f"{where}.selector: {route.selector} matches no backend")
            for backend in targets(self, route):
                if route.model not in backend.models:
                    raise ValueError(f"{where}.model: backend {backend.name!r} does not serve {route.model!r}")
        seen: set[tuple[str, str | None]] = set()
        for i, route in enumerate(self.routes):
            for name in (route.model, *route.aliases):
                if (name, route.service_class) in seen:
                    raise ValueError(f"routes.{i}: {name!r} is routed twice for service class {route.service_class}")
                seen.add((name, route.service_class))
        keys = [k.key for k in self.api_keys]
        if len(set(keys)) != len(keys):
            raise ValueError("api_keys: keys must be unique")
        return self


def targets(config: GatewayConfig, route: RouteConfig) -> list[BackendConfig]:
    """The back ends a route sends to, in config order."""
    return [
        b
        for b in config.backends
        if b.name in route.backends or (route.selector and route.selector.items() <= b.labels.items())
    ]


def load_config(path: str | Path) -> GatewayConfig:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    try:
        return GatewayConfig.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            message = error["msg"].removeprefix("Value error, ")
            field = ".".join(str(p) for p in error["loc"])
            problems.append(f"{field}: {message}" if field else message)
        raise ConfigError(f"{path}: " + "; ".join(problems)) from None
