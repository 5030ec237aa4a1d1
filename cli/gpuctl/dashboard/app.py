"""The dashboard's routes: pages (Jinja2, autoescaped), their JSON twins under /api, live output
as server-sent events, and the three actions.

A page is rendered whole on the server from readmodel.py; the few lines of dashboard.js refresh a
page's live part, follow a log (EventSource) and ask before an action. Every list is paginated,
so no answer grows with the state.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, AsyncIterator, Callable
from urllib.parse import parse_qs

import jinja2
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from gpuctl import __version__
from gpuctl.common.errors import UserError
from gpuctl.dashboard import commands, readmodel
from gpuctl.dashboard.refresh import HeadWatch, SharedStateSync
from gpuctl.dashboard.security import Guard, GuardMiddleware
from gpuctl.managed.store import Store
from gpuctl.spec.request import check_cluster_name
from gpuctl.state.registry import JOB_STATES, Registry

HERE = Path(__file__).parent
SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _span(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60}s"
    hours = seconds // 3600
    return f"{hours}h {seconds % 3600 // 60}m" if hours < 48 else f"{hours // 24}d {hours % 24}h"


def _money(value: float | None, free: bool = False) -> str:
    return "no cloud bill" if free else ("unknown" if value is None else f"${value:,.2f}")


def _templates() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(when=_when, span=_span, money=_money)
    return env


def _int(request: Request, key: str, default: int) -> int:
    try:
        return int(request.query_params.get(key, default))
    except ValueError:
        return default


class Dashboard:
    """The app's state: the guard, the templates, the background watchers and the actions."""

    def __init__(self, guard: Guard, *, shared: bool = False) -> None:
        self.guard = guard
        self.env = _templates()
        self.heads = HeadWatch()
        self.actions = commands.Actions()
        self.sync = SharedStateSync() if shared else None
        for name in self.env.list_templates():  # compiled once, not on a user's first visit
            self.env.get_template(name)

    @functools.cached_property
    def registry(self) -> Registry:
        """One for every request: its constructor checks the schema (a write), its reads do not."""
        return Registry()

    @functools.cached_property
    def store(self) -> Store:
        return Store()

    # -- helpers -------------------------------------------------------------------------------

    def render(self, request: Request, name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
        html = self.env.get_template(name).render(
            request=request, csrf=self.guard.csrf_token(), version=__version__, now=time.time(),
            sync_error=self.sync.last_error if self.sync else None, shared=self.sync is not None, **context)
        return HTMLResponse(html, status_code=status_code,
                            headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
                                     "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                                                                "style-src 'self'; frame-ancestors 'none'",
                                     "Referrer-Policy": "no-referrer"})

    def not_found(self, request: Request, what: str) -> HTMLResponse:
        return self.render(request, "error.html", status_code=404, title="Not found", message=what)

    # -- pages ---------------------------------------------------------------------------------

    def clusters_doc(self, request: Request) -> dict[str, Any]:
        q = request.query_params
        tab = q.get("tab", "up")
        registry = self.registry
        if tab == "history":
            page = readmodel.gone_clusters(registry, query=q.get("q", ""), page=_int(request, "page", 1),
                                           per_page=_int(request, "per_page", readmodel.PER_PAGE))
        else:
            page = readmodel.clusters(registry, query=q.get("q", ""), status=q.get("status", ""),
                                      sort=q.get("sort", "name"), descending=q.get("dir") == "desc",
                                      page=_int(request, "page", 1),
                                      per_page=_int(request, "per_page", readmodel.PER_PAGE), idle=self.heads.idle)
        return {"tab": tab, "page": page, "q": q.get("q", ""), "status": q.get("status", ""),
                "sort": q.get("sort", "name"), "dir": q.get("dir", "asc")}

    def clusters(self, request: Request) -> Response:
        return self.render(request, "clusters.html", title="Clusters", **self.clusters_doc(request))

    def cluster(self, request: Request) -> Response:
        name = request.path_params["name"]
        doc = readmodel.cluster(self.registry, name, idle=self.heads.idle)
        if doc is None:
            return self.not_found(request, f"No cluster '{name}' in this state (nor jobs of one).")
        return self.render(request, "cluster.html", title=f"Cluster {name}", c=doc)

    def jobs(self, request: Request) -> Response:
        q = request.query_params
        page = readmodel.jobs(self.registry, cluster=q.get("cluster"), status=q.get("status"),
                              page=_int(request, "page", 1), per_page=_int(request, "per_page", readmodel.PER_PAGE))
        return self.render(request, "jobs.html", title="Jobs", page=page, cluster=q.get("cluster", ""),
                           status=q.get("status", ""), states=JOB_STATES + ("LOST",))

    def job(self, request: Request) -> Response:
        name, job_id = request.path_params["name"], request.path_params["job_id"]
        doc = readmodel.job(self.registry, name, job_id)
        if doc is None:
            return self.not_found(request, f"Cluster '{name}' has no job {job_id}.")
        rank = request.query_params.get("rank")
        return self.render(request, "job.html", title=f"Job {job_id} on {name}", j=doc,
                           rank=int(rank) if rank and rank.isdigit() else None)

    def managed(self, request: Request) -> Response:
        page = readmodel.managed_jobs(self.store, page=_int(request, "page", 1),
                                      per_page=_int(request, "per_page", readmodel.PER_PAGE))
        return self.render(request, "managed.html", title="Managed jobs", page=page)

    def managed_job(self, request: Request) -> Response:
        job_id = request.path_params["job_id"]
        doc = readmodel.managed_job(self.store, job_id)
        if doc is None:
            return self.not_found(request, f"No managed job {job_id}.")
        return self.render(request, "managed_job.html", title=f"Managed job {job_id}", m=doc)

    def cost(self, request: Request) -> Response:
        doc = readmodel.cost(self.registry, page=_int(request, "page", 1), per_page=_int(request, "per_page", 100))
        return self.render(request, "cost.html", title="Cost", cost=doc)

    def action_page(self, request: Request) -> Response:
        run = self.actions.runs.get(request.path_params["run"])
        if run is None:
            return self.not_found(request, "No such action (the dashboard keeps the latest ones).")
        return self.render(request, "action.html", title=run.title, run=run)

    # -- JSON ------------------------------------------------------------------------------------

    def api(self, build: Callable[[Request], Any]) -> Callable[[Request], Response]:
        def endpoint(request: Request) -> Response:
            doc = build(request)
            if doc is None:
                return JSONResponse({"ok": False, "error": "not found"}, status_code=404)
            # JSONResponse's own encoding, with the pages (read-model Pages) rendered in the same pass
            return Response(json.dumps({"ok": True, **doc}, default=_page_json, ensure_ascii=False, allow_nan=False,
                                       separators=(",", ":")).encode(), media_type="application/json")
        return endpoint

    # -- live output -----------------------------------------------------------------------------

    async def job_events(self, request: Request) -> Response:
        name, job_id = request.path_params["name"], request.path_params["job_id"]
        rank = request.query_params.get("rank")
        words = commands.logs_words(name, job_id, int(rank) if rank and rank.isdigit() else None, follow=True)

        def ended() -> dict[str, Any]:
            record = self.registry.job(name, job_id)
            return {"status": record.status if record else None}
        return _sse(request, commands.lines_of(words), ended)

    async def managed_events(self, request: Request) -> Response:
        attempt, stage = request.query_params.get("attempt"), request.query_params.get("stage")
        words = commands.managed_logs_words(request.path_params["job_id"],
                                            int(attempt) if attempt and attempt.isdigit() else None,
                                            stage=int(stage) if stage and stage.isdigit() else None)

        def ended() -> dict[str, Any]:
            job = self.store.get(request.path_params["job_id"])
            return {"status": job.status if job else None}
        return _sse(request, commands.lines_of(words), ended)

    async def action_events(self, request: Request) -> Response:
        run = self.actions.runs.get(request.path_params["run"])
        if run is None:
            return Response(status_code=404)

        async def lines() -> AsyncIterator[str]:
            shown = 0
            while True:
                while shown < len(run.lines):
                    yield run.lines[shown]
                    shown += 1
                if run.returncode is not None and shown >= len(run.lines):
                    return
                run.changed.clear()
                try:
                    await asyncio.wait_for(run.changed.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass
        return _sse(request, lines(), lambda: {"returncode": run.returncode})

    async def job_log(self, request: Request) -> Response:
        name, job_id = request.path_params["name"], request.path_params["job_id"]
        rank = request.query_params.get("rank")
        try:
            code, out = await commands.output_of(commands.logs_words(
                name, job_id, int(rank) if rank and rank.isdigit() else None, follow=False))
        except asyncio.TimeoutError:
            return Response("the log could not be read in time\n", status_code=504, media_type="text/plain")
        suffix = f"-rank{rank}" if rank and rank.isdigit() else ""
        return Response(out, media_type="text/plain; charset=utf-8", headers={
            "Content-Disposition": f'attachment; filename="{name}-job{job_id}{suffix}.log"',
            "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"})

    # -- actions ---------------------------------------------------------------------------------

    async def act(self, request: Request) -> Response:
        form = await _form(request)
        if not self.guard.csrf_ok(str(form.get("csrf") or "")):
            return Response("403: the form's CSRF token is missing or wrong: reload the page and try again",
                            status_code=403, media_type="text/plain")
        what = request.path_params["what"]
        try:
            if what == "cancel":
                name, job_id = check_cluster_name(str(form.get("cluster"))), int(str(form.get("job")))
                run = self.actions.begin_call(
                    f"Cancel job {job_id} on {name}", functools.partial(commands.cancel_job, name, job_id),
                    f"/clusters/{name}/jobs/{job_id}", "gpuctl " + " ".join(commands.cancel_words(name, job_id)))
            elif what == "cancel-managed":
                job_id = int(str(form.get("job")))
                run = self.actions.begin(f"Cancel managed job {job_id}", commands.cancel_managed_words(job_id),
                                         f"/managed/{job_id}")
            elif what == "down":
                name = check_cluster_name(str(form.get("cluster")))
                if str(form.get("confirm") or "").strip() != name:
                    return self.render(request, "error.html", status_code=400, title="Not taken down",
                                       message=f"To take cluster '{name}' down, type its name in the box; "
                                               "nothing was done.")
                run = self.actions.begin(f"Down cluster {name}", commands.down_words(name), "/clusters")
            else:
                return self.not_found(request, f"No action '{what}'.")
        except (UserError, ValueError) as exc:
            return self.render(request, "error.html", status_code=400, title="Bad request", message=str(exc))
        await self.actions.wait_done(run, timeout=0.5 if what == "down" else 10.0)
        return RedirectResponse(f"/actions/{run.id}", status_code=303)

    # -- the app ---------------------------------------------------------------------------------

    def app(self) -> Starlette:
        api = self.api
        routes = [
            Route("/", lambda request: RedirectResponse("/clusters", status_code=302)),
            Route("/clusters", self.clusters),
            Route("/clusters/{name}", self.cluster),
            Route("/clusters/{name}/jobs/{job_id:int}", self.job),
            Route("/clusters/{name}/jobs/{job_id:int}/events", self.job_events),
            Route("/clusters/{name}/jobs/{job_id:int}/log", self.job_log),
            Route("/jobs", self.jobs),
            Route("/managed", self.managed),
            Route("/managed/{job_id:int}", self.managed_job),
            Route("/managed/{job_id:int}/events", self.managed_events),
            Route("/cost", self.cost),
            Route("/actions/{what}", self.act, methods=["POST"]),
            Route("/actions/{run}", self.action_page),
            Route("/actions/{run}/events", self.action_events),
            Route("/api/clusters", api(self.clusters_doc)),
            Route("/api/clusters/{name}", api(lambda r: readmodel.cluster(self.registry, r.path_params["name"],
                                                                          idle=self.heads.idle))),
            Route("/api/jobs", api(lambda r: {"page": readmodel.jobs(
                self.registry, cluster=r.query_params.get("cluster"), status=r.query_params.get("status"),
                page=_int(r, "page", 1), per_page=_int(r, "per_page", readmodel.PER_PAGE))})),
            Route("/api/managed", api(lambda r: {"page": readmodel.managed_jobs(
                self.store, page=_int(r, "page", 1), per_page=_int(r, "per_page", readmodel.PER_PAGE))})),
            Route("/api/cost", api(lambda r: readmodel.cost(self.registry, page=_int(r, "page", 1),
                                                            per_page=_int(r, "per_page", 100)))),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ]
        return Starlette(routes=routes, lifespan=self._lifespan,
                         exception_handlers={UserError: self._user_error, Exception: self._failure},
                         middleware=[Middleware(GuardMiddleware, guard=self.guard)])

    def _failure(self, request: Request, exc: Exception) -> Response:
        """A page that could not be made says why, in the page (the traceback goes to the terminal)."""
        traceback.print_exception(exc, file=sys.stderr)
        return self.render(request, "error.html", status_code=500, title="This page could not be made",
                           message=f"{type(exc).__name__}: {exc} (the terminal running `gpuctl dashboard` has the "
                                   "details)")

    def _user_error(self, request: Request, exc: Exception) -> Response:
        return self.render(request, "error.html", status_code=400, title="Bad request", message=str(exc))

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        if self.sync is not None:
            self.sync.start()
        try:
            yield
        finally:
            self.heads.close()
            if self.sync is not None:
                self.sync.stopped.set()


async def _form(request: Request) -> dict[str, str]:
    """An action's form (urlencoded, as the pages send it; a few short fields): parsed here, so the
    dashboard needs no multipart parser."""
    body = await request.body()
    if len(body) > 16384:
        return {}
    return {k: v[0] for k, v in parse_qs(body.decode(errors="replace"), max_num_fields=16).items()}


def _page_json(value: Any) -> Any:
    if isinstance(value, readmodel.Page):
        return {"rows": value.rows, "page": value.number, "per_page": value.per_page, "total": value.total,
                "pages": value.pages}
    return str(value)


def _sse(request: Request, lines: AsyncIterator[str], ended: Callable[[], dict[str, Any]]) -> StreamingResponse:
    """Lines as server-sent events, numbered: a browser that reconnects (Last-Event-ID) gets only
    the lines it has not shown. Then an `end` event with how it ended; the page closes the stream."""
    try:
        skip = int(request.headers.get("last-event-id", "0"))
    except ValueError:
        skip = 0

    async def events() -> AsyncIterator[str]:
        yield "retry: 2000\n\n"
        number = 0
        try:
            async for line in lines:
                number += 1
                if number > skip:
                    yield f"id: {number}\ndata: {line}\n\n"
        except UserError as exc:
            yield f"event: failure\ndata: {exc}\n\n"
        yield f"event: end\ndata: {json.dumps(ended())}\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

