"""Back-end state: outstanding requests (for balancing) and a circuit breaker fed by active health checks
and by the outcome of real requests, so a dead back end leaves the rotation before clients notice twice."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from heteroserve.entrypoints.gateway.config import BackendConfig, HealthConfig

logger = logging.getLogger("heteroserve.gateway")


class Backend:
    """One back end. The breaker is closed (`up`) or open; a connection error or a failed health check
    opens it at once, `failure_threshold` consecutive 5xx answers too. An open breaker closes when a
    health check succeeds after `cooldown` seconds."""

    def __init__(self, config: BackendConfig, health: HealthConfig) -> None:
        self.config, self.health = config, health
        self.outstanding = 0
        self.up = True
        self.opened_at = 0.0
        self.consecutive_5xx = 0
        self.cards: dict[str, dict] = {}  # its /v1/models cards by model id, as of the last health check

    @property
    def name(self) -> str:
        return self.config.name

    def load(self) -> float:
        """What this back end's load would be with one more request: weighted fewest-outstanding."""
        return (self.outstanding + 1) / self.config.weight

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

    def record_success(self) -> None:
        self.consecutive_5xx = 0

    def record_5xx(self) -> None:
        self.consecutive_5xx += 1
        if self.consecutive_5xx >= self.health.failure_threshold:
            self.open(f"{self.consecutive_5xx} consecutive 5xx answers")

    def open(self, reason: str) -> None:
        if self.up:
            logger.warning("back end %s taken out: %s", self.name, reason)
        self.up = False
        self.opened_at = time.monotonic()

    async def check(self, client: httpx.AsyncClient) -> None:
        """One active health check; it may take the back end out or bring it back in."""
        try:
            response = await client.get(
                self.config.url.rstrip("/") + self.health.path, headers=self.headers(), timeout=self.health.timeout
            )
            healthy = response.status_code == 200
            reason = f"health check answered {response.status_code}"
        except httpx.HTTPError as exc:
            healthy, reason = False, f"health check failed: {exc!r}"
        if not healthy:
            self.open(reason)
            return
        if not self.up and time.monotonic() - self.opened_at >= self.health.cooldown:
            self.up, self.consecutive_5xx = True, 0
            logger.info("back end %s is back in", self.name)
        await self._read_cards(client)

    async def _read_cards(self, client: httpx.AsyncClient) -> None:
        """The back end's model cards, so the gateway's own say what each model is for and takes (a heteroserve
        server's `task` and `capabilities`). Informative only: routing never depends on them."""
        try:
            response = await client.get(
                self.config.url.rstrip("/") + "/v1/models", headers=self.headers(), timeout=self.health.timeout
            )
            if response.status_code == 200:
                data = response.json().get("data", [])
                self.cards = {c["id"]: c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)}
        except (httpx.HTTPError, ValueError, AttributeError):
            pass


async def check_all(backends: list[Backend], client: httpx.AsyncClient) -> None:
    await asyncio.gather(*(b.check(client) for b in backends))
