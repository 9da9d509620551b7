"""The control path across nodes: requests for running ranks (checkpoint now, dump stacks).

    POST /api/v1/jobs/{job}/control      the recovery controller asks (kind, ranks or "all", id)
    GET  /api/v1/jobs/{job}/control/{id} where the request's acknowledgements stand
    GET  /api/v1/control?node=<node>     a node agent's pending requests: those of jobs with
                                         ranks on its node (the store's ranks table) that these
                                         ranks have not acknowledged yet
    POST /api/v1/control/{id}/ack        a node agent reports the ranks whose SDK acknowledged
                                         (and, for dump_stacks, each rank's stacks)

And `advise` mode's approvals, for actions the controller posted as `proposed`:

    GET  /api/v1/actions/{id}/approval   where a proposed action stands
    POST /api/v1/actions/{id}/approve    a person approves it (409 unless proposed or approved)

Every route takes the ingest scope (controllers and node agents hold ingest tokens). A request
is pending for `PENDING_S` after it was posted; one the ranks never answer expires then. Must
not talk to agents or ranks itself: agents poll.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Query
from fastapi.responses import Response
from sqlalchemy import select, update
from sqlalchemy.engine import Connection

from vigil import api
from vigil.collector import auth, dialects, tables
from vigil.collector import models as m
from vigil.collector.context import CollectorContext, json_response
from vigil.collector.routes_query import reject_nul

# 10 min: longer than any checkpoint a controller waits for; an older request is not pending.
PENDING_S = 600.0
PROPOSED, APPROVED = "proposed", "approved"  # ActionState values (`advise` mode)
# A node agent gets at most this many requests per poll (oldest first; the rest come next poll).
MAX_PENDING = 100
JobId = Annotated[str, Path(min_length=1, max_length=256)]
RequestId = Annotated[str, Path(min_length=1, max_length=200)]
Node = Annotated[str, Query(min_length=1, max_length=256)]
_ERRORS: dict[int | str, dict[str, Any]] = {
    c: {"model": m.ErrorPublic} for c in (401, 403, 404, 409)
}


def router(ctx: CollectorContext) -> APIRouter:
    ingest = Depends(auth.require(auth.Scope.INGEST, ctx.settings))
    r = APIRouter(
        prefix=api.API_PREFIX,
        dependencies=[ingest, Depends(reject_nul)],
        responses=_ERRORS,
        tags=["control"],
    )

    @r.post("/jobs/{job_id}/control", status_code=201, response_model=m.ControlPublic)
    def create(job_id: JobId, body: m.ControlIn) -> Response:
        """Ask the job's ranks to run their `kind` callback at their next step boundary."""
        ranks = None if body.ranks == "all" else sorted(set(body.ranks))
        if ranks is not None and not ranks:
            raise HTTPException(422, detail='ranks: give at least one rank, or "all"')
        request_id = body.id or uuid.uuid4().hex
        row = {
            "request_id": request_id,
            "job_id": job_id,
            "kind": body.kind,
            "ranks": ranks,
            "created_s": ctx.clock(),
        }
        with ctx.store.write() as conn:
            fresh = dialects.insert_ignore(conn, tables.control_requests, row)
        with ctx.store.read() as conn:
            found = _status(conn, request_id)
        assert found is not None
        if not fresh and (found["job_id"], found["kind"], found["ranks"]) != (
            job_id,
            body.kind,
            ranks,
        ):
            raise HTTPException(409, detail=f"control request {request_id!r} exists, differently")
        return json_response(found, 201 if fresh else 200)

    @r.get("/jobs/{job_id}/control/{request_id}", response_model=m.ControlPublic)
    def status(job_id: JobId, request_id: RequestId, details: bool = False) -> Response:
        """The request and the ranks that acknowledged it (`details`: with their answers)."""
        with ctx.store.read() as conn:
            found = _status(conn, request_id, details=details)
        if found is None or found["job_id"] != job_id:
            raise HTTPException(404, detail=f"no control request {request_id!r} for {job_id!r}")
        return json_response(found)

    @r.get("/control", response_model=list[m.PendingControlPublic])
    def pending(node: Node) -> Response:
        """The requests a node agent should deliver: for ranks on `node`, not yet acknowledged."""
        with ctx.store.read() as conn:
            return json_response(_pending(conn, node, ctx.clock() - PENDING_S))

    @r.post("/control/{request_id}/ack", response_model=m.ControlPublic)
    def ack(request_id: RequestId, body: m.ControlAckIn) -> Response:
        """Record that these ranks' SDK acknowledged the request."""
        with ctx.store.read() as conn:
            found = _status(conn, request_id)
        if found is None:
            raise HTTPException(404, detail=f"no control request {request_id!r}")
        asked = found["ranks"]
        stray = sorted(set(body.ranks) - set(asked)) if asked is not None else []
        if stray:
            raise HTTPException(422, detail=f"ranks {stray} were not asked by {request_id!r}")
        unacked = sorted(set(body.details) - set(body.ranks))
        if unacked:
            raise HTTPException(422, detail=f"details: ranks {unacked} are not among the ranks")
        now = ctx.clock()
        with ctx.store.write() as conn:
            for rank in sorted(set(body.ranks)):
                dialects.insert_ignore(
                    conn,
                    tables.control_acks,
                    {
                        "request_id": request_id,
                        "rank": rank,
                        "node": body.node,
                        "acked_s": now,
                        "detail": body.details.get(rank, ""),
                    },
                )
        with ctx.store.read() as conn:
            return json_response(_status(conn, request_id))

    @r.get("/actions/{action_id:path}/approval", response_model=m.ApprovalPublic)
    def approval(action_id: str) -> Response:
        """Where a proposed action stands (`advise` mode: the controller waits for approved)."""
        with ctx.store.read() as conn:
            return json_response(_approval(conn, action_id))

    @r.post("/actions/{action_id:path}/approve", response_model=m.ApprovalPublic)
    def approve(action_id: str) -> Response:
        """Approve an action the controller proposed (`advise` mode); it then carries it out."""
        act = tables.actions
        with ctx.store.write() as conn:
            found = _approval(conn, action_id)
            if found["state"] not in (PROPOSED, APPROVED):
                raise HTTPException(
                    409, detail=f"action {action_id!r} is {found['state']}, not proposed"
                )
            conn.execute(update(act).where(act.c.action_id == action_id).values(state=APPROVED))
        return json_response({**found, "state": APPROVED})

    return r


_APPROVAL_FIELDS = ("action_id", "job_id", "kind", "target", "state", "result")


def _approval(conn: Connection, action_id: str) -> dict[str, Any]:
    act = tables.actions
    row = (
        conn.execute(
            select(*(act.c[k] for k in _APPROVAL_FIELDS)).where(act.c.action_id == action_id)
        )
        .mappings()
        .first()
    )
    if row is None:
        raise HTTPException(404, detail=f"no action {action_id!r}")
    return dict(row)


def _status(conn: Connection, request_id: str, *, details: bool = False) -> dict[str, Any] | None:
    req = tables.control_requests
    row = conn.execute(select(req).where(req.c.request_id == request_id)).mappings().first()
    if row is None:
        return None
    acks = tables.control_acks
    answers = {
        int(rank): str(detail)
        for rank, detail in conn.execute(
            select(acks.c.rank, acks.c.detail).where(acks.c.request_id == request_id)
        ).all()
    }
    acked = sorted(answers)
    ranks = None if row["ranks"] is None else [int(r) for r in row["ranks"]]
    if ranks is None:
        known = tables.ranks
        expected = sorted(
            int(r)
            for r in conn.execute(
                select(known.c.rank).where(known.c.job_id == row["job_id"])
            ).scalars()
        )
    else:
        expected = ranks
    out: dict[str, Any] = {
        "id": row["request_id"],
        "job_id": row["job_id"],
        "kind": row["kind"],
        "ranks": ranks,
        "created_s": float(row["created_s"]),
        "expected": expected,
        "acked": acked,
        "done": bool(expected) and set(expected) <= set(acked),
    }
    out["details"] = answers if details else None
    return out


def _pending(conn: Connection, node: str, since_s: float) -> list[dict[str, Any]]:
    req, known, acks = tables.control_requests, tables.ranks, tables.control_acks
    local = conn.execute(select(known.c.job_id, known.c.rank).where(known.c.node == node)).all()
    by_job: dict[str, set[int]] = {}
    for job_id, rank in local:
        by_job.setdefault(str(job_id), set()).add(int(rank))
    if not by_job:
        return []
    rows = (
        conn.execute(
            select(req)
            .where(req.c.job_id.in_(sorted(by_job)), req.c.created_s >= since_s)
            .order_by(req.c.created_s, req.c.request_id)
        )
        .mappings()
        .all()
    )
    out: list[dict[str, Any]] = []
    for row in rows:
        mine = by_job[row["job_id"]]
        asked = mine if row["ranks"] is None else mine & {int(r) for r in row["ranks"]}
        done = {
            int(r)
            for r in conn.execute(
                select(acks.c.rank).where(acks.c.request_id == row["request_id"])
            ).scalars()
        }
        todo = sorted(asked - done)
        if todo:
            out.append(
                {
                    "id": row["request_id"],
                    "job_id": row["job_id"],
                    "kind": row["kind"],
                    "ranks": todo,
                    "created_s": float(row["created_s"]),
                }
            )
        if len(out) >= MAX_PENDING:
            break
    return out
