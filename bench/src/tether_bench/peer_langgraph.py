"""The peer workload: the same scripted agent on LangGraph with its PostgreSQL checkpointer, for steps/s side by side.

The agent is a two-node LangGraph graph (`agent` → `tools` → `agent` ... → end). `agent` asks the
same scripted model server Tether's planner asks (OpenAI chat completions over HTTP, the same
scenario, zero latency); `tools` runs each proposed kv_get against the same KV dev service over
HTTP. Every super-step is checkpointed to PostgreSQL by `AsyncPostgresSaver` with
`durability="sync"` (the checkpoint is written before the next step starts: LangGraph's durable
mode). LangGraph runs in one process per core (`processes`), each with `concurrency` runs in flight
on asyncio, so it gets the same two cores Tether's six processes share.

    python -m tether_bench.peer_langgraph worker --dsn ... --schema ... --model-url ... --kv-url ...
        --goal-marker '[scenario:bench-fast]' --concurrency 16 --seconds 30 --out result.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import operator
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, TypedDict

import httpx
import psycopg
from psycopg import sql

KV_GET_TOOL = {"type": "function", "function": {
    "name": "kv_get", "description": "Read the JSON value stored under a key in the key-value store.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"],
                   "additionalProperties": False}}}


# How long past its measured window a worker may take (start-up, the last runs, writing its result).
WORKER_OVERRUN_S = 300.0


class AgentState(TypedDict):
    messages: Annotated[list[dict[str, Any]], operator.add]


def build_graph(model_url: str, kv_url: str, http: httpx.AsyncClient, marks: list[float]):
    """The agent graph: `agent` calls the model, `tools` runs the calls, until the model answers."""
    from langgraph.graph import END, START, StateGraph

    async def agent(state: AgentState, config) -> dict[str, Any]:
        if len(state["messages"]) > 2:
            marks.append(time.time())  # the previous step (tools + its checkpoint) is done
        run_id = config["configurable"]["thread_id"]
        turn = sum(1 for m in state["messages"] if m["role"] == "assistant")
        response = await http.post(f"{model_url}/chat/completions", json={
            "model": "tether-scripted", "messages": state["messages"], "tools": [KV_GET_TOOL]},
            headers={"X-Tether-Run": run_id, "X-Tether-Step": str(turn + 1), "X-Tether-Call": "0"})
        response.raise_for_status()
        message = response.json()["choices"][0]["message"]
        out = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            out["tool_calls"] = message["tool_calls"]
        return {"messages": [out]}

    async def tools(state: AgentState) -> dict[str, Any]:
        results = []
        for call in state["messages"][-1].get("tool_calls", []):
            key = json.loads(call["function"]["arguments"])["key"]
            response = await http.get(f"{kv_url}/kv/{key}")
            content = response.json() if response.status_code == 200 else {"key": key, "found": False}
            results.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(content)})
        return {"messages": results}

    def route(state: AgentState) -> str:
        return "tools" if state["messages"][-1].get("tool_calls") else END

    graph = StateGraph(AgentState)
    graph.add_node("agent", agent)
    graph.add_node("tools", tools)
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", route, ["tools", END])
    graph.add_edge("tools", "agent")
    return graph


def prepare_schema(dsn: str, schema: str) -> None:
    """A schema of its own with LangGraph's checkpoint tables (its `setup()`)."""
    from langgraph.checkpoint.postgres import PostgresSaver

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=0, options=f"-c search_path={schema}") as conn:
        PostgresSaver(conn).setup()


def drop_schema(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


async def _worker(args: argparse.Namespace) -> dict[str, Any]:
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
    from psycopg.rows import dict_row
    from psycopg_pool import AsyncConnectionPool

    marks: list[float] = []
    runs_done = 0
    failures: list[str] = []
    async with AsyncConnectionPool(
        args.dsn, min_size=4, max_size=max(4, args.concurrency), open=False,
        kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row,
                "options": f"-c search_path={args.schema}"},
    ) as pool, httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=args.concurrency * 2)) as http:
        graph = build_graph(args.model_url, args.kv_url, http, marks).compile(checkpointer=AsyncPostgresSaver(pool))
        deadline = time.monotonic() + args.seconds
        start = time.time()

        async def client() -> None:
            nonlocal runs_done
            while time.monotonic() < deadline:
                run_id = uuid.uuid4().hex
                goal = f"{args.goal_marker} {run_id}"
                try:
                    await graph.ainvoke(
                        {"messages": [{"role": "system", "content": "You are a benchmark agent."},
                                      {"role": "user", "content": goal}]},
                        {"configurable": {"thread_id": run_id}}, durability="sync")
                except Exception as exc:  # noqa: BLE001 - counted and reported, the bench goes on
                    failures.append(repr(exc)[:300])
                    continue
                marks.append(time.time())
                runs_done += 1

        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        end = time.time()
    return {"start": start, "end": end, "step_marks": marks, "runs": runs_done, "failures": failures[:5],
            "failure_count": len(failures)}


def run_peer(*, dsn: str, model_url: str, kv_url: str, goal_marker: str, steps_per_run: int, processes: int,
             concurrency: int, seconds: float, warmup_s: float, workdir: Path, python: str = sys.executable
             ) -> dict[str, Any]:
    """Run the LangGraph workload in `processes` processes at once; steps/s over the common window."""
    schema = f"bench_langgraph_{uuid.uuid4().hex[:8]}"
    prepare_schema(dsn, schema)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        outs = []
        for i in range(processes):
            out = workdir / f"langgraph-{i}.json"
            outs.append(out)
            with open(workdir / f"langgraph-{i}.log", "w") as log:
                # A session of its own: a terminal's Ctrl-C reaches the bench alone, whose finally stops it.
                procs.append(subprocess.Popen(
                    [python, "-m", "tether_bench.peer_langgraph", "worker", "--dsn", dsn, "--schema", schema,
                     "--model-url", model_url, "--kv-url", kv_url, "--goal-marker", goal_marker,
                     "--concurrency", str(max(1, concurrency // processes)), "--seconds", str(seconds),
                     "--out", str(out)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True))
        deadline = time.monotonic() + seconds + WORKER_OVERRUN_S
        for proc in procs:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        results = [json.loads(out.read_text()) for out in outs if out.exists()]
        if len(results) != processes:
            raise RuntimeError(f"LangGraph workers failed; see {workdir}/langgraph-*.log")
        window_start = max(r["start"] for r in results) + warmup_s
        window_end = min(r["end"] for r in results)
        steps = sum(1 for r in results for t in r["step_marks"] if window_start <= t <= window_end)
        width = max(0.001, window_end - window_start)
        return {
            "steps_per_s": round(steps / width, 1), "steps": steps, "window_s": round(width, 1),
            "runs": sum(r["runs"] for r in results), "failures": sum(r["failure_count"] for r in results),
            "failure_samples": [f for r in results for f in r["failures"]][:3],
            "processes": processes, "concurrency": concurrency, "steps_per_run": steps_per_run,
            "durability": "sync", "checkpointer": "AsyncPostgresSaver",
        }
    finally:
        stop_workers(procs)
        drop_schema(dsn, schema)


def stop_workers(procs: list[subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
    """Stop the workers still running (the bench was stopped, or they overran): SIGTERM to each one's
    process group, then SIGKILL to the groups still there after `grace_s`. Left alone they would keep
    running, orphaned, against a dropped schema."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=grace_s)


def _signal_group(proc: subprocess.Popen[bytes], signum: int) -> None:
    # Each worker leads its own session, so its process group id is its pid.
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    worker = sub.add_parser("worker")
    for name in ("--dsn", "--schema", "--model-url", "--kv-url", "--goal-marker", "--out"):
        worker.add_argument(name, required=True)
    worker.add_argument("--concurrency", type=int, default=16)
    worker.add_argument("--seconds", type=float, default=30)
    args = parser.parse_args(argv)
    result = asyncio.run(_worker(args))
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
