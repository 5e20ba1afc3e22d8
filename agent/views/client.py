"""A small client for the collector's REST API (reads, and the steering requests of
``stepwatch capture`` / ``stepwatch config``), with errors that say what to do.

Every failure becomes a :class:`CollectorError` whose message names the URL and the next
step (start a collector, pass ``--url``, check the token, pick another run), so that the
commands built on it print one helpful line instead of a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from ..config import DEFAULT_URL

JSON = dict[str, Any]


class CollectorError(RuntimeError):
    """The collector could not answer; the message says why and what to do next."""


@dataclass(frozen=True)
class Snapshot:
    """One consistent-enough read of a run: everything a view shows, fetched together."""

    overview: JSON
    ranks: list[JSON]
    events: list[JSON]
    step_times: list[JSON] = field(default_factory=list)


class CollectorClient:
    """Reads runs, overviews, ranks, events and series from ``url`` (``/api/v1``)."""

    def __init__(self, url: str = DEFAULT_URL, *, token: str | None = None, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=headers)

    def __enter__(self) -> CollectorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _get(self, path: str, **params: Any) -> Any:
        return self._call("GET", path, params=params)

    def _call(self, method: str, path: str, *, params: JSON | None = None, body: JSON | None = None) -> Any:
        query = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            resp = self._http.request(method, f"/api/v1{path}", params=query, json=body)
        except httpx.ConnectError as exc:
            raise CollectorError(
                f"no collector answers at {self.url} ({exc.__class__.__name__}). Start one with "
                "`stepwatch serve`, or point at yours with --url (or STEPWATCH_URL)."
            ) from exc
        except httpx.TimeoutException as exc:
            raise CollectorError(
                f"the collector at {self.url} did not answer in time; it may be overloaded or its "
                "database unreachable. Check its /readyz."
            ) from exc
        except httpx.HTTPError as exc:
            raise CollectorError(f"request to {self.url} failed: {exc}. Check the URL.") from exc
        if resp.status_code in (401, 403):
            kind = "read" if method == "GET" else "admin (STEPWATCH_ADMIN_TOKENS)"
            raise CollectorError(
                f"the collector at {self.url} refused the request ({resp.status_code}: {_detail(resp)}); "
                f"pass one of its {kind} tokens with --token (or STEPWATCH_TOKEN)."
            )
        if resp.status_code == 404:
            raise CollectorError(
                f"{_detail(resp)} (at {self.url}); `stepwatch top --url {self.url}` lists runs."
            )
        if resp.status_code == 503:
            raise CollectorError(
                f"the collector at {self.url} is up but its database is not ({_detail(resp)}); "
                "it answers again when the database is back."
            )
        if resp.status_code >= 400:
            raise CollectorError(f"the collector at {self.url} answered {resp.status_code}: {_detail(resp)}")
        try:
            return resp.json()
        except ValueError as exc:
            raise CollectorError(
                f"{self.url} answered, but not with JSON: is it a stepwatch collector? Check --url."
            ) from exc

    def runs(self) -> list[JSON]:
        runs: list[JSON] = self._get("/runs")
        return runs

    def overview(self, run: str) -> JSON:
        ov: JSON = self._get(f"/runs/{run}")
        return ov

    def ranks(self, run: str) -> list[JSON]:
        ranks: list[JSON] = self._get(f"/runs/{run}/ranks")
        return ranks

    def events(self, run: str) -> list[JSON]:
        events: list[JSON] = self._get(f"/runs/{run}/events")
        return events

    def series(self, run: str, metric: str, *, max_points: int = 60, from_step: int | None = None) -> JSON:
        s: JSON = self._get(f"/runs/{run}/series", metric=metric, max_points=max_points, from_step=from_step)
        return s

    def capture(self, run: str, **target: Any) -> JSON:
        """Ask for a capture (``rank=``, ``ranks=``, ``host=`` or ``all=True``; ``steps=``)."""
        out: JSON = self._call(
            "POST",
            f"/runs/{run}/captures",
            body={k: v for k, v in target.items() if v is not None and v is not False},
        )
        return out

    def get_capture(self, run: str, ident: int) -> JSON:
        out: JSON = self._get(f"/runs/{run}/captures/{ident}")
        return out

    def put_config(self, run: str, settings: dict[str, float], ranks: list[int] | None = None) -> JSON:
        out: JSON = self._call("PUT", f"/runs/{run}/config", body={"settings": settings, "ranks": ranks})
        return out

    def snapshot(self, run: str, *, last_steps: int = 120, points: int = 48) -> Snapshot:
        """Overview, ranks, events and the recent step-time series of one run."""
        ov = self.overview(run)
        last = ov.get("last_step")
        from_step = max(0, int(last) - last_steps + 1) if last is not None else None
        try:
            steps = self.series(run, "step_time_s", max_points=points, from_step=from_step)["points"]
        except CollectorError:
            steps = []
        return Snapshot(overview=ov, ranks=self.ranks(run), events=self.events(run), step_times=steps)


def _detail(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:200] or resp.reason_phrase
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])
    return str(body)[:200]
