"""The systems ``bench/peers.py`` measures, built: rig's engine on a backend (``run_rig``), the
resubmit loop on a client (``bench/resubmit.py``), the vLLM ones on one shared ``AsyncLLM`` (its
prefix cache reset before every run), and llama-server's slots erased before every run."""

from __future__ import annotations

import inspect
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.append(str(Path(__file__).resolve().parent))  # bench/, as when run as a script (the tests load this file)
from peers_report import Hop, RunResult  # noqa: E402
from resubmit import VllmCompleter, run_resubmit  # noqa: E402


def log(msg: str) -> None:
    print(f"[peers] {msg}", file=sys.stderr, flush=True)


@dataclass
class System:
    name: str
    run: Callable[[list[list[int]], int, int], RunResult]
    """(prompts, concurrency, max_new_tokens) -> one measured run."""
    before_run: Callable[[], None] | None = None
    """Called before every run (the vLLM systems: reset the shared engine's prefix cache)."""


def run_rig(name: str, build_engine: Callable[[int], object], prompts: list[list[int]], concurrency: int,
            max_new_tokens: int) -> RunResult:
    """All questions queued at once; the engine (``build_engine(concurrency)``, max batch size =
    concurrency) keeps ``concurrency`` of them decoding. A hop's latency is the trace's
    ``first_token_ms`` (the marker's completion to the first token after the evidence); a row that
    finished at its marker has none, and that hop is left out."""
    engine = build_engine(concurrency)
    try:
        seqs = [engine.new_sequence(p, seq_id=i, max_new_tokens=max_new_tokens) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        engine.generate(seqs)
        wall = time.perf_counter() - t0
        calls = getattr(getattr(engine, "runner", None), "calls", None)
    finally:
        engine.close()
    hops = [Hop(s.seq_id, step.first_token_ms, _evaluated(step)) for s in seqs for step in s.trace.retrieval_steps
            if step.first_token_ms is not None]
    return RunResult(name, concurrency, wall, [s.matcher.visible_text().strip() for s in seqs],
                     [s.trace.generated_tokens for s in seqs], [s.trace.total_ms - s.trace.queue_ms for s in seqs],
                     hops, finish=[s.finish_reason or "" for s in seqs],
                     errors=[e for s in seqs for e in s.trace.engine_errors], calls=calls,
                     decode_ms=[s.trace.decode_ms for s in seqs],
                     decode_tokens=[s.trace.generated_tokens - 1 - sum(st.first_token_ms is not None
                                                                       for st in s.trace.retrieval_steps) for s in seqs],
                     plans=[replay_plan(s) for s in seqs])


def replay_plan(s) -> list[tuple[list[int], int, float]]:
    """A finished row as ``vllm-alone`` replays it: per stretch, (the ids sent before it: the prompt,
    then the end marker and the evidence; tokens decoded in it; ms waited before it: the hop's search)."""
    plan, start, wait = [], len(s.prompt_ids), 0.0
    chunk = list(s.prompt_ids)
    for step in s.trace.retrieval_steps:
        if not step.evidence_tokens:
            break
        plan.append((chunk, step.position - start, wait))
        chunk = list(s.token_ids[step.position - 1:step.position + step.evidence_tokens])
        start, wait = step.position + step.evidence_tokens, step.latency_ms
    if len(s.token_ids) > start:
        plan.append((chunk, len(s.token_ids) - start, wait))
    return plan


def run_alone(engine, api, loop, plans: list, concurrency: int) -> RunResult:
    """vLLM with no rig in the loop, on the same rows: each row one resumable request whose chunks are
    the ids rig sent (prompt; end marker + evidence), each decoding greedily as many tokens as rig's
    row did there (``ignore_eos``, no log-probabilities), after the same search wait; ``concurrency``
    rows at a time. A hop's latency: the last token before it to the first after it."""
    import asyncio
    import uuid

    async def row(i, gate):
        async with gate:
            t0, hops, decode_ms, decoded, generated = time.perf_counter(), [], 0.0, 0, 0
            inbox, last = asyncio.Queue(), None

            async def inputs():
                while (item := await inbox.get()) is not None:
                    yield item

            params = api.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                        output_kind=api.RequestOutputKind.DELTA)
            outputs = engine.generate(inputs(), params, f"alone-{uuid.uuid4().hex[:12]}")
            for chunk, n, wait_ms in plans[i]:
                await asyncio.sleep(wait_ms / 1e3)
                sp = api.SamplingParams(max_tokens=max(1, n), temperature=0.0, ignore_eos=True,
                                        output_kind=api.RequestOutputKind.DELTA)
                inbox.put_nowait(api.StreamingInput(prompt=api.TokensPrompt(prompt_token_ids=chunk), sampling_params=sp))
                first = got = None
                async for out in outputs:
                    now, k = time.perf_counter(), len(out.outputs[0].token_ids)
                    first, got = first or now, (got or 0) + k
                    if out.outputs[0].finish_reason is not None:
                        break
                if last is not None:
                    hops.append(Hop(i, (first - last) * 1e3, len(chunk)))
                decode_ms, decoded, generated = decode_ms + (now - first) * 1e3, decoded + got - 1, generated + got
                last = now
            inbox.put_nowait(None)
            async for _ in outputs:
                pass
            return generated, (time.perf_counter() - t0) * 1e3, hops, decode_ms, decoded

    async def every():
        gate = asyncio.Semaphore(concurrency)
        return await asyncio.gather(*(row(i, gate) for i in range(len(plans))))

    t0 = time.perf_counter()
    done = loop.run(every())
    return RunResult("vllm-alone", concurrency, time.perf_counter() - t0, [], [d[0] for d in done],
                     [d[1] for d in done], [h for d in done for h in d[2]], decode_ms=[d[3] for d in done],
                     decode_tokens=[d[4] for d in done])


def _evaluated(step) -> int:
    """Tokens the engine evaluated to take a hop's evidence in: what llama-server reported, else the
    evidence block plus the end-marker token."""
    server = step.info.get("server")
    return server.get("prompt_n") if server else step.evidence_tokens + 1


def _vllm_engine(cfg, api):
    from rig_decode.engine.runner_vllm import EventLoopThread
    from rig_decode.engine.vllm_api import engine_args_kwargs

    args = api.AsyncEngineArgs(**engine_args_kwargs(cfg, api))
    loop = EventLoopThread("peers-vllm")

    async def start():  # on the loop thread: AsyncLLM binds its output handler to the running loop
        return api.AsyncLLM.from_engine_args(args)

    try:
        return loop, loop.run(start())
    except BaseException:
        loop.close()
        raise


def vllm_systems(vcfg, api, names, tokenizer, retriever, rig_system, loop_kw):
    """The vLLM systems of ``names`` on one shared ``AsyncLLM``, and the function that shuts it down.
    Only ``held`` refers to the engine, so that shutting down can drop it: ``AsyncLLM.__del__``
    then runs now, not at interpreter exit (where vLLM's module globals are gone)."""
    import gc

    from rig_decode.engine.runner_vllm import vllm_runner_on

    loop, engine = _vllm_engine(vcfg, api)
    held = {"engine": engine}
    del engine
    v = vcfg.engine.vllm
    reset = _reset_prefix_cache(held, loop)
    systems, completers = [], []
    plans: dict[int, list] = {}  # rig-vllm-stream's rows, by concurrency: what vllm-alone replays
    for n in names:
        if n == "vllm-alone":
            systems.append(System(n, lambda p, c, k: run_alone(held["engine"], api, loop, _plans_for(plans, p, c, k), c),
                                  reset))
        elif n == "resubmit-vllm":
            complete = VllmCompleter(held["engine"], api, loop)
            completers.append(complete)
            systems.append(System(n, lambda p, c, k, complete=complete: run_resubmit(
                "resubmit-vllm", complete, tokenizer, retriever, p, c, k, context_limit=v.max_model_len, **loop_kw),
                reset))
        else:
            mode = n.rsplit("-", 1)[1]
            system = rig_system(n, lambda c, mode=mode: vllm_runner_on(
                held["engine"], api, len(tokenizer), mode=mode, top_logprobs=v.top_logprobs, lookahead=v.lookahead,
                context_limit=v.max_model_len, loop=loop, owns_loop=False), vcfg, None, reset)
            if mode == "stream":
                system.run = _recording(system.run, plans)
            systems.append(system)

    def stop():
        async def shutdown(engine):
            engine.shutdown(timeout=30)

        try:
            loop.run(shutdown(held["engine"]), timeout=120)
        finally:
            held.clear()
            for c in completers:
                c.engine = None
            gc.collect()
            loop.close()

    return systems, stop


def _plans_for(plans: dict[int, list], prompts, concurrency: int, max_new_tokens: int) -> list:
    """rig-vllm-stream's rows at this concurrency, or (before it ran: the warm-up) each prompt decoded
    for ``max_new_tokens``."""
    recorded = plans.get(concurrency)
    if recorded and len(recorded) == len(prompts):
        return recorded
    return [[(list(ids), max_new_tokens, 0.0)] for ids in prompts]


def _recording(run, plans: dict[int, list]):
    def recorded(prompts, concurrency, max_new_tokens):
        result = run(prompts, concurrency, max_new_tokens)
        if len(prompts) > 1:  # not the warm-up's
            plans[concurrency] = result.plans
        return result

    return recorded


def _reset_prefix_cache(held: dict, loop):
    def reset():
        fn = getattr(held.get("engine"), "reset_prefix_cache", None)
        if fn is None:
            return

        async def call():
            r = fn()
            return await r if inspect.isawaitable(r) else r

        try:
            loop.run(call(), timeout=60)
        except Exception as e:  # noqa: BLE001 - a cache that stays warm is reported, not fatal
            log(f"could not reset vLLM's prefix cache: {type(e).__name__}: {e}")

    return reset


def erase_llama_slots(base_url: str):
    """llama-server's counterpart of resetting vLLM's prefix cache: erase every slot's KV before a run,
    so no system starts on prompts an earlier one left there. The server needs ``--slot-save-path``
    for the erase action and ``--cache-ram 0`` so that no prompt comes back from its host-memory
    cache; without them the run goes on and the log says the cache stays warm."""
    from rig_decode.engine.servers import HttpServer, RemoteError

    def erase():
        server = HttpServer(base_url)
        try:
            slots = server.get("/slots")
            if not slots:
                log("llama-server lists no slots (/slots): its cache stays warm between runs")
            for slot in slots or []:
                server.post(f"/slots/{slot['id']}?action=erase", {})
        except RemoteError as e:
            log(f"llama-server's slots were not erased ({e}): start it with --slot-save-path DIR --cache-ram 0")
        finally:
            server.close()

    return erase
